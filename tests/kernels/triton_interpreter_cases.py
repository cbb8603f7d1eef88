"""The Triton kernel's parity cases, run on CPU under Triton's interpreter by tests/kernels/test_triton_interpreter.py.

    TRITON_INTERPRET=1 python tests/kernels/triton_interpreter_cases.py REPO_ROOT     # prints one JSON line

TRITON_INTERPRET must be set before Triton is imported, and once imported Triton keeps the mode it
started in; so the cases run in a child process of their own and the pytest process never sees the
variable. Importing this module (for CASES) imports neither torch nor Triton.

Each case calls the public kernel (psoftmax_attention, ssmax_attention, softmax1_attention) inside
force_backend("triton"), so the dispatch, the custom op and its backward are what is tested, forward and
backward against a float64 reference (tests/kernels/test_kernels.py) computed from the same (rounded) inputs.
Shapes are small: the interpreter runs each tile op in numpy (a 40 x 40 case takes ~0.3 s).
"""

from __future__ import annotations

# name -> (kernel, setting of tests.kernels.test_kernels.SETTINGS or a head size, p, dtype). p applies to psoftmax.
CASES = {}
for _p in (1.0, 1.5, 2.0, 3.0, 4.0):
    CASES[f"psoftmax-causal-p{_p:g}-fp32"] = ("psoftmax", "causal", _p, "float32")
for _setting in ("full", "decode", "prefill_chunk", "more_q_than_k", "pad_bool", "pad_additive",
                 "bias_and_causal_chunk", "gqa", "gqa_pad"):
    CASES[f"psoftmax-{_setting}-p2-fp32"] = ("psoftmax", _setting, 2.0, "float32")
for _setting in ("causal", "decode", "gqa_pad", "pad_additive"):
    CASES[f"psoftmax-{_setting}-p2-fp16"] = ("psoftmax", _setting, 2.0, "float16")
CASES["psoftmax-gqa_pad-p3-fp16"] = ("psoftmax", "gqa_pad", 3.0, "float16")
for _dim in (80, 96, 256):
    CASES[f"psoftmax-head{_dim}-p2-fp32"] = ("psoftmax", _dim, 2.0, "float32")
CASES["psoftmax-head96-p1.5-fp16"] = ("psoftmax", 96, 1.5, "float16")
for _kernel in ("ssmax", "softmax1"):
    for _setting in ("causal", "gqa_pad", "decode"):
        CASES[f"{_kernel}-{_setting}-fp32"] = (_kernel, _setting, 1.0, "float32")
    CASES[f"{_kernel}-pad_bool-fp16"] = (_kernel, "pad_bool", 1.0, "float16")


def _inputs(tk, setting, dtype):

    if isinstance(setting, int):  # head size: a short causal GQA call
        q, k, v = tk.qkv(B=1, H=4, Hkv=2, Tq=12, Tk=20, D=setting, dtype=dtype, seed=setting)
        return q, k, v, dict(causal=True)
    return tk.make(setting, dtype)


def run_case(tk, K, name):
    """Max |error| of out, dq, dk, dv (and d extra) against the float64 reference, and the reference's max |out|."""
    import torch

    kernel, setting, p, dtype = CASES[name]
    q, k, v, kw = _inputs(tk, setting, getattr(torch, dtype))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    extra = None if kernel == "psoftmax" else tk.extra_param(q.shape[1], torch.float32).requires_grad_()
    wrt = (q, k, v) if extra is None else (q, k, v, extra)
    gqa = q.shape[1] != k.shape[1]
    with K.force_backend("triton"):
        if kernel == "psoftmax":
            out = K.psoftmax_attention(q, k, v, p, enable_gqa=gqa, **kw)
        else:
            out = getattr(K, f"{kernel}_attention")(q, k, v, extra, enable_gqa=gqa, **kw)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        grads = torch.autograd.grad(out, wrt, dout)
    ref = (tk.naive_psoftmax(q, k, v, p, **kw) if kernel == "psoftmax" else
           tk.naive_ssmax(q, k, v, extra, **kw) if kernel == "ssmax" else tk.naive_softmax1(q, k, v, extra, **kw))
    ref_grads = torch.autograd.grad(ref, wrt, dout.double())
    errors = [(a.double() - b).abs().max().item() for a, b in zip((out, *grads), (ref, *ref_grads))]
    return {"errors": errors, "finite": all(bool(x.isfinite().all()) for x in (out, *grads)),
            "dtype": str(out.dtype), "ref_max": ref.abs().max().item()}


def main(root: str) -> None:
    import json
    import os
    import sys
    import time
    import types

    assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
    pkg = types.ModuleType("retrofit")  # the kernels alone: skip retrofit's heavy __init__ (transformers)
    pkg.__path__ = [os.path.join(root, "retrofit")]
    sys.modules["retrofit"] = pkg
    sys.path.insert(0, root)
    import torch

    import retrofit.kernels as K
    from tests.kernels import test_kernels as tk

    torch.set_num_threads(1)
    triton = K.triton_backend()
    assert triton is not None and triton.INTERPRETED
    calls = []
    for fn in ("forward", "backward"):  # count the Triton kernel's own calls: no other backend may stand in
        setattr(triton, fn, lambda *a, _real=getattr(triton, fn), _fn=fn, **kw: calls.append(_fn) or _real(*a, **kw))
    results = {}
    for name in CASES:
        start, calls[:] = time.perf_counter(), []
        results[name] = run_case(tk, K, name)
        results[name].update(seconds=round(time.perf_counter() - start, 2), triton_calls=list(calls))
    print(json.dumps(results))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
