"""retrofit's softmax seam computes what transformers' own `sdpa_attention_forward` computes, on the same tensors.

A kernel norm runs retrofit's kernels in the model's attention function's place: `kernel_call` translates what
transformers hands an attention function (mask or None, GQA, scaling, dropout, the model's sinks) through
`visible_keys`, whose docstring says it mirrors transformers' `sdpa_attention_forward` exactly. transformers changed
that function in 5.24 (the version here packs a single query's GQA heads and adds a `position_bias`), and nothing
else pins the seam to it. Here p-softmax at
p = 1 — softmax through `kernel_call` and retrofit's own kernel, not the wrapped sdpa that the `softmax` norm calls —
is called through the attention function `retrofit.patch` registers, beside transformers' function on the same
(query, key, value, mask) and the same attention module: forward and gradients.

Learned sinks (gpt_oss's `s_aux`): `sdpa_attention_forward` takes none (a model with sinks has no sdpa path, and the
function ignores an `s_aux` kwarg), so there the seam is pinned to the model's own eager function, which retrofit
wraps for such models (`retrofit_eager`).

Tolerances: float64 1e-12 — both sides compute the same sums in another order (float64 rounding, ~1e-16 per
operation, over a few dozen terms); float32 2e-6 — the same for float32 (eps 1.2e-7) on O(1) outputs. A difference
in meaning (one key more or less, another scale, a missing sink) moves the outputs by more than 1e-2:
`test_the_comparison_sees_*` show it.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask, sliding_window_causal_mask_function
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

import retrofit
from retrofit.errors import RetrofitError
from retrofit.kernels import force_backend
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
B, H, D = 2, 4, 8  # tests/tiny.py's Llama: 4 query heads of 8 channels
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6}
# The CPU backends a softmax call can take (dispatch.py): what it picks for these shapes (cpu_fused), and the others.
BACKENDS = ["cpu_fused", "decode", "blockwise"]
PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])  # row 0 left-padded by 2 (2D, as users pass)


@functools.cache
def patched_attention(model_type: str, kv_heads: int):
    """(retrofit's registered attention function, one attention module) of a tiny model patched with p-softmax p = 1."""
    model = tiny_model(model_type, num_key_value_heads=kv_heads)
    retrofit.patch(model, "psoftmax", p=1.0)
    module = next(m for m in model.modules() if hasattr(m, "retrofit"))
    assert module.num_key_value_groups == H // kv_heads
    return ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation], module


def bool_mask(tq: int, tk: int, shift: int = 0, **kwargs) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool, True = attend: causal over the last Tq of Tk positions with PAD, as transformers'
    sdpa_mask builds it for a padded batch (a KV cache when Tk > Tq); `shift` > 0 shows each query that many later
    keys too (a wrong mask, for the negative check)."""
    mask = sdpa_mask(batch_size=B, q_length=tq, kv_length=tk, q_offset=tk - tq + shift,
                     attention_mask=PAD[:, :tk].bool(), **kwargs)
    assert mask is not None and mask.dtype == torch.bool
    return mask


def float_mask(tq: int, tk: int, dtype) -> torch.Tensor:
    """(B, H, Tq, Tk) additive: a per-head bias on the keys bool_mask shows, dtype's min on the others (what a user's
    custom 4D mask, or ALiBi folded into one, hands the attention function). The bias values are float32 numbers:
    retrofit's fused CPU kernel adds a float mask in float32 (kernels/cpu_fused.py), which rounds a float64 bias
    by ~1e-8; values exact in float32 keep that rounding, which is no part of the seam, out of the comparison."""
    bias = torch.randn(B, H, tq, tk, generator=torch.Generator().manual_seed(5)).to(dtype)
    return torch.where(bool_mask(tq, tk), bias, torch.finfo(dtype).min)


# name -> (Tq, Tk, the mask for a dtype). None masks: Tq > 1 is causal; Tq > 1 with Tk > Tq is a prefill into an empty
# static cache (only the first Tq keys are real); Tq = 1 is a decode step that sees every key.
MASKS = {
    "none-causal": (6, 6, lambda dtype: None),
    "none-static-cache-prefill": (4, 8, lambda dtype: None),
    "none-decode": (1, 7, lambda dtype: None),
    "bool-padding-causal": (8, 8, lambda dtype: bool_mask(8, 8)),
    "bool-cached-chunk": (3, 8, lambda dtype: bool_mask(3, 8)),
    "bool-decode": (1, 8, lambda dtype: bool_mask(1, 8)),
    "bool-sliding-window": (8, 8, lambda dtype: bool_mask(8, 8, mask_function=sliding_window_causal_mask_function(3))),
    "float-padding-causal": (8, 8, lambda dtype: float_mask(8, 8, dtype)),
    "float-decode": (1, 8, lambda dtype: float_mask(1, 8, dtype)),  # per-head mask: 5.24 packs GQA queries with it
}


def qkv(tq: int, tk: int, kv_heads: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, tq, D, generator=g, dtype=dtype)  # (B, H, Tq, D)
    k, v = (torch.randn(B, kv_heads, tk, D, generator=g, dtype=dtype) for _ in range(2))  # (B, Hkv, Tk, D)
    return q, k, v


def run(fn, module, q, k, v, mask, rows, **kwargs):
    """fn's output (B, Tq, H, D) and the gradients of q, k, v for a fixed random upstream gradient on `rows`."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = fn(module, q, k, v, mask, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * upstream * rows).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def seen_rows(mask, tq: int) -> torch.Tensor:
    """(B or 1, Tq, 1, 1): 1.0 on query rows that see at least one key. A padding query that sees none is no one's
    output (its label is ignored); sdpa gives it 0 under a bool mask but the mean of every value under an additive
    one (dtype's min is finite), retrofit 0 under both: the comparison leaves those rows out, forward and backward."""
    if mask is None:
        return torch.ones(1, tq, 1, 1)
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return visible.any(-1).any(1).double().view(mask.shape[0], tq, 1, 1)


def assert_same(got, want, rows, dtype):
    tol = TOLERANCE[dtype]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        a, b = (a * rows, b * rows) if name == "out" else (a, b)  # the gradients of unseen rows: 0 upstream
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("scaling", [None, 0.3], ids=["default-scale", "scale-0.3"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_softmax_through_kernel_call_is_transformers_sdpa(mask_name, kv_heads, scaling, training, dtype, backend):
    """For every mask transformers hands an sdpa attention function (none: causal, static-cache prefill, decode; its
    bool padding, KV-cache chunk and sliding-window masks; an additive float mask), MHA, GQA and MQA, the default or
    an explicit scale, in eval or training mode with dropout 0, on each CPU backend: retrofit's attention function
    with p-softmax p = 1 gives sdpa_attention_forward's output and gradients of q, k and v."""
    tq, tk, make_mask = MASKS[mask_name]
    fn, module = patched_attention("llama", kv_heads)
    q, k, v = qkv(tq, tk, kv_heads, dtype)
    mask = make_mask(dtype)
    rows = seen_rows(mask, tq).to(dtype)
    module.train(training)
    try:
        with force_backend(backend):
            got = run(fn, module, q, k, v, mask, rows, scaling=scaling, dropout=0.0)
        want = run(sdpa_attention_forward, module, q, k, v, mask, rows, scaling=scaling, dropout=0.0)
    finally:
        module.eval()
    assert got[0].shape == want[0].shape == (B, tq, H, D)
    assert_same(got, want, rows, dtype)


# gpt_oss's sliding layers see the last 4 keys (tests/tiny.py); its eager function takes transformers' additive mask.
SINK_MASKS = {
    "causal": (8, 8, lambda: eager_mask(batch_size=B, q_length=8, kv_length=8, dtype=torch.float64)),
    "padding-causal": (8, 8, lambda: eager_mask(batch_size=B, q_length=8, kv_length=8, dtype=torch.float64,
                                                attention_mask=PAD.bool())),
    "sliding-window": (8, 8, lambda: eager_mask(batch_size=B, q_length=8, kv_length=8, dtype=torch.float64,
                                                mask_function=sliding_window_causal_mask_function(4))),
    "decode": (1, 8, lambda: eager_mask(batch_size=B, q_length=1, kv_length=8, q_offset=7, dtype=torch.float64,
                                        attention_mask=PAD.bool())),
    "decode-none": (1, 8, lambda: None),
}


@pytest.mark.parametrize("scaling", [8 ** -0.5, 0.3], ids=["model-scale", "scale-0.3"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask_name", list(SINK_MASKS))
def test_softmax_with_the_models_sinks_is_its_eager_function(mask_name, kv_heads, scaling):
    """A model with learned sinks (gpt_oss passes s_aux=self.sinks): retrofit's attention function with p-softmax
    p = 1 (softmax+1's kernel with the model's sink) gives the model's eager function's output and gradients, the
    sinks' included. float64; the sinks are set far from their near-zero init so that they matter."""
    tq, tk, make_mask = SINK_MASKS[mask_name]
    fn, module = patched_attention("gpt_oss", kv_heads)
    q, k, v = qkv(tq, tk, kv_heads, torch.float64)
    mask = make_mask()
    rows = seen_rows(mask, tq)
    results = []
    for attention in (fn, gpt_oss_eager):  # retrofit_eager wraps the model's own eager function
        module.double().zero_grad()
        with torch.no_grad():
            module.sinks.copy_(torch.linspace(-2.0, 3.0, H))
        results.append((*run(attention, module, q, k, v, mask, rows, scaling=scaling, dropout=0.0, s_aux=module.sinks),
                        module.sinks.grad.clone()))
    got, want = results
    assert_same(got[:4], want[:4], rows, torch.float64)
    torch.testing.assert_close(got[4], want[4], atol=1e-12, rtol=1e-12)


def test_the_comparison_sees_a_shifted_mask():
    """The seam comparison can fail: retrofit given the causal mask shifted by one key (each query also sees the next
    key), transformers the true one, differ far beyond the tolerance, forward and backward."""
    fn, module = patched_attention("llama", 2)
    q, k, v = qkv(8, 8, 2, torch.float64)
    mask, shifted = bool_mask(8, 8), bool_mask(8, 8, shift=1)
    assert (shifted & ~mask).any() and not (mask & ~shifted).any()  # one more key on most rows, none fewer
    rows = seen_rows(mask, 8)
    got = run(fn, module, q, k, v, shifted, rows, dropout=0.0)
    want = run(sdpa_attention_forward, module, q, k, v, mask, rows, dropout=0.0)
    for a, b in zip(got, want):
        assert (a - b).abs().max() > 1e-2
    assert_same(run(fn, module, q, k, v, mask, rows, dropout=0.0), want, rows, torch.float64)  # unshifted: equal


def test_the_comparison_sees_a_dropped_sink():
    """The sink comparison can fail: the model's eager function without its sinks (set to -inf) is not what retrofit
    computes with them."""
    fn, module = patched_attention("gpt_oss", 2)
    q, k, v = qkv(8, 8, 2, torch.float64)
    mask = eager_mask(batch_size=B, q_length=8, kv_length=8, dtype=torch.float64)
    module.double()
    with torch.no_grad():
        module.sinks.copy_(torch.linspace(-2.0, 3.0, H))
    got, _ = fn(module, q, k, v, mask, scaling=0.3, dropout=0.0, s_aux=module.sinks)
    sinkless = copy.deepcopy(module)  # the cached module keeps its sinks
    with torch.no_grad():
        sinkless.sinks.fill_(-torch.inf)
    want, _ = gpt_oss_eager(sinkless, q, k, v, mask, scaling=0.3, dropout=0.0)
    assert (got - want).abs().max() > 1e-2


def position_bias(tq: int, tk: int) -> torch.Tensor:
    """(B, H, Tq, Tk) float64, O(4): a relative position bias as a model hands it to the attention function. Its
    values are float32 numbers, for the reason float_mask's are: the bias goes into an additive mask."""
    return 4.0 * torch.randn(B, H, tq, tk, generator=torch.Generator().manual_seed(4)).double()


def test_position_bias_is_added_or_refused():
    """transformers 5.24's sdpa_attention_forward adds a `position_bias` (B, H, Tq, Tk) to the logits (Inkling's
    relative position bias arrives so, with sdpa support): retrofit's seam adds it too, or refuses the call in one
    line, as it refuses sinks it would drop; it never computes without it."""
    fn, module = patched_attention("llama", 2)
    q, k, v = qkv(8, 8, 2, torch.float64)
    bias = position_bias(8, 8)
    try:
        got, _ = fn(module, q, k, v, None, dropout=0.0, position_bias=bias)
    except RetrofitError:
        return  # refused loudly: also a fix
    want, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, position_bias=bias)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_position_bias_is_added_as_sdpa_adds_it(mask_name, kv_heads):
    """With a `position_bias`, for every mask transformers hands an sdpa attention function (none: causal,
    static-cache prefill, decode; bool; additive float), retrofit's attention function with p-softmax p = 1 gives
    sdpa_attention_forward's output and gradients of q, k and v (float64): the bias is added to the logits where a
    query may attend, cropped with the keys of an empty static cache's prefill. Under an additive float mask the
    tolerance is float32's: the sum of the mask and the bias (float32 numbers each) is not one, and the fused CPU
    kernel adds the mask in float32 (see float_mask)."""
    tq, tk, make_mask = MASKS[mask_name]
    fn, module = patched_attention("llama", kv_heads)
    q, k, v = qkv(tq, tk, kv_heads, torch.float64)
    mask, bias = make_mask(torch.float64), position_bias(tq, tk)
    rows = seen_rows(mask, tq).double()
    got = run(fn, module, q, k, v, mask, rows, dropout=0.0, position_bias=bias)
    want = run(sdpa_attention_forward, module, q, k, v, mask, rows, dropout=0.0, position_bias=bias)
    summed = mask is not None and mask.is_floating_point()
    assert_same(got, want, rows, torch.float32 if summed else torch.float64)
    unbiased = run(sdpa_attention_forward, module, q, k, v, mask, rows, dropout=0.0)
    assert (got[0] - unbiased[0]).abs().max() > 1e-2  # the bias matters here: a dropped one would be seen


@functools.cache
def patched_with(norm: str):
    """(retrofit's registered attention function, one attention module) of a tiny GQA Llama patched with `norm`."""
    model = tiny_model("llama", num_key_value_heads=2).double()
    retrofit.patch(model, norm)
    module = next(m for m in model.modules() if hasattr(m, "retrofit"))
    return ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation], module


@pytest.mark.parametrize("norm", sorted(retrofit.norms.NORMS))
def test_every_norm_takes_a_position_bias_as_an_additive_mask(norm):
    """Every registered norm, kernel norms (p-softmax, SSMax, softmax+1: kernel_call) and the ones that run the
    wrapped sdpa alike, computes with a `position_bias` what it computes with that bias folded into the additive
    float mask by hand (the bias where the bool mask attends, float64's min elsewhere), and not what it computes
    without it."""
    fn, module = patched_with(norm)
    q, k, v = qkv(8, 8, 2, torch.float64)
    mask, bias = bool_mask(8, 8), position_bias(8, 8)
    rows = seen_rows(mask, 8).double()
    with torch.no_grad():
        got, _ = fn(module, q, k, v, mask, dropout=0.0, position_bias=bias)
        folded, _ = fn(module, q, k, v, torch.where(mask, bias, torch.finfo(torch.float64).min), dropout=0.0)
        unbiased, _ = fn(module, q, k, v, mask, dropout=0.0)
    torch.testing.assert_close(got * rows, folded * rows, atol=1e-12, rtol=1e-12)
    assert ((got - unbiased) * rows).abs().max() > 1e-2
