"""The Triton kernel in CI, on CPU, through Triton's interpreter: parity with a float64 reference, forward and
backward, for every case in tests/kernels/triton_interpreter_cases.py (fp32 and fp16; p = 1 .. 4; GQA; bool and
additive masks; decode; Tq != Tk; head sizes 80/96/256; rows with no visible key; SSMax and softmax+1).

TRITON_INTERPRET=1 has to be set before Triton is imported, and Triton keeps the mode it was imported in, so
all cases run in one child process with that variable (never set in this process, so it cannot leak into other
tests); each case is then its own test here. bf16 is not checked this way: under the interpreter a bare
tl.dot of two bf16 tiles is off by ~1e10 (the interpreter's limitation, not the kernel's). bf16 runs on CUDA
(tests/kernels/test_kernels.py::test_triton_low_precision and test_triton_matches_blockwise).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.triton_interpreter_cases import CASES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (it is in the test extra)")

# |kernel - float64 reference| on values of size ~1-4. fp32: measured <= 4e-6. fp16: the kernel rounds
# the weights to fp16 before the P V product and returns fp16 results: measured <= 4e-3, one fp16 ulp at 4.
TOLERANCE = {"torch.float32": 1e-5, "torch.float16": 8e-3}


@pytest.fixture(scope="module")
def results():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cases = os.path.join(root, "tests", "kernels", "triton_interpreter_cases.py")
    child = subprocess.run([sys.executable, cases, root],
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_triton_in_interpreter_matches_reference(results, case):
    got = results[case]
    assert got["triton_calls"] == ["forward", "backward"]  # the Triton kernel itself ran, both ways
    assert got["dtype"] == f"torch.{CASES[case][3]}" and got["finite"]
    errors = dict(zip(["out", "dq", "dk", "dv", "dextra"], got["errors"]))
    assert max(errors.values()) <= TOLERANCE[got["dtype"]], errors


def test_interpreter_variable_stays_in_the_child(results):
    assert "TRITON_INTERPRET" not in os.environ  # the parent (every other test) never runs interpreted


@pytest.mark.skip(reason="Triton's interpreter computes a bf16 tl.dot wrong by ~1e10 (its limitation); "
                         "bf16 runs on CUDA in tests/kernels/test_kernels.py")
def test_triton_in_interpreter_bf16():
    raise AssertionError("not run under the interpreter")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the same cases on the GPU, bf16 included")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_triton_on_cuda_matches_reference(dtype):
    import retrofit.kernels as K
    from tests import test_kernels as tk

    for name, (kernel, setting, p, _) in CASES.items():
        q, k, v, kw = tk.make(setting, getattr(torch, dtype)) if isinstance(setting, str) else (*tk.qkv(
            B=1, H=4, Hkv=2, Tq=12, Tk=20, D=setting, dtype=getattr(torch, dtype)), dict(causal=True))
        q, k, v = (x.cuda() for x in (q, k, v))
        kw = {a: b.cuda() if torch.is_tensor(b) else b for a, b in kw.items()}
        extra = tk.extra_param(q.shape[1], torch.float32).cuda()
        with K.force_backend("triton"):
            out = tk.call(kernel, q, k, v, extra, **kw) if kernel != "psoftmax" else K.psoftmax_attention(
                q, k, v, p, enable_gqa=q.shape[1] != k.shape[1], **kw)
        _, reference, param = tk.KERNELS[kernel]
        ref = (tk.naive_psoftmax(q, k, v, p, **kw) if kernel == "psoftmax" else reference(q, k, v, extra, **kw))
        torch.testing.assert_close(out.double(), ref, rtol=0.03, atol=0.03, msg=name)
