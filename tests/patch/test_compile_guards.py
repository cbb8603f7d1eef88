"""A compiled model runs what its eager self runs, whatever else of its class was compiled first (issue #36).

Dynamo caches one graph per code object and reuses it for any model whose guards pass. It does not guard on a
module's hooks (torch._dynamo.config.skip_nnmodule_hook_guards), and AVNorm acts through hooks: without the mark
norms/base.py puts on each hooked projection, a graph traced through an unpatched model ran on a patched one
without the norm (and back), silently. Each case compiles an unpatched and a patched model of the same class, in
both orders, then runs both again (Dynamo tries its most recent graph first), and compares each to eager.
"""

from __future__ import annotations

import pytest
import torch

import retrofit
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CASES = {
    "avnorm": ("avnorm", {}),
    "avnorm-beyond": ("avnorm", {"mode": "beyond", "ref_len": 4, "exponent": 0.5}),
    "avnorm-layers": ("avnorm", {"layers": [1]}),
    "avnorm-heads": ("avnorm", {"heads": [0, 1]}),
    # the kernel norms change config._attn_implementation, on which Dynamo guards exactly: one stands for all
    "softmax1": ("softmax1", {}),
    # a gated patch runs retrofit's attention function and a pre-hook on each attention module (issue 55)
    "avnorm-gate": ("avnorm", {"gate": "head"}),
    "softmax-gate-post": ("softmax", {"gate": "head:0.5:12"}),
}


def _compiled_runs(first, second, ids):
    """Logits of torch.compile(first), then of torch.compile(second), then of each again: one cache for both."""
    torch._dynamo.reset()
    out = {}
    for model in (first, second, first, second):
        out.setdefault(id(model), []).append(torch.compile(model, backend="eager")(input_ids=ids).logits)
    return out


@pytest.mark.parametrize("patched_first", [False, True], ids=["plain-first", "patched-first"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_runs_what_eager_runs(case, patched_first):
    norm, options = CASES[case]
    plain, patched = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(patched, norm, **options)
    ids = random_ids(2, 8)
    with torch.no_grad():
        eager = {id(m): m(input_ids=ids).logits for m in (plain, patched)}
        assert not torch.allclose(eager[id(plain)], eager[id(patched)], atol=1e-4)  # the norm changes something
        order = (patched, plain) if patched_first else (plain, patched)
        compiled = _compiled_runs(*order, ids)
    for model, what in ((plain, "plain"), (patched, "patched")):
        for run, logits in enumerate(compiled[id(model)]):
            torch.testing.assert_close(logits, eager[id(model)], rtol=1e-5, atol=1e-5, msg=f"{what}, run {run}")


def test_unpatched_model_compiles_as_plain_again():
    """unpatch removes the mark too: the model's compiled self matches a never-patched twin, hooks and all."""
    plain, model = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(model, "avnorm")
    ids = random_ids(2, 8)
    torch._dynamo.reset()
    with torch.no_grad():
        patched_logits = torch.compile(model, backend="eager")(input_ids=ids).logits
        retrofit.unpatch(model)
        assert all("forward" not in m.__dict__ and not m._forward_pre_hooks for m in model.modules())
        compiled = _compiled_runs(model, plain, ids)
        want = plain(input_ids=ids).logits
    assert not torch.allclose(patched_logits, want, atol=1e-4)
    for logits in compiled[id(model)] + compiled[id(plain)]:
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
