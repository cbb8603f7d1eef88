"""The patcher's test matrix: every registered norm with its example options and each of its example variants (avnorm's
kinds, ...), with and without NoPE, on several families.

Checks per combination: parity with an independent reference (tests/reference.py), causality,
KV-cache generation, left padding, unpatch, gradients, bf16 stability. Save/reload in a fresh process
is in tests/load/test_reload.py; bad input in test_patch_errors.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import retrofit
from retrofit.norms import AttentionShape, Norm, get_norm, make_options
from tests.reference import reference_model
from tests.tiny import TINY, random_ids, tiny_model


def _configurations() -> dict[str, tuple[str, dict]]:
    """Every registered norm with its example_options, then with each of its example_variants (the other formulas its
    file computes: avnorm kind=layer and global, psoftmax p=3, softmax1's fixed sink): key -> (norm, options). A new
    norm is in the matrix by being registered."""
    out = {}
    for name in retrofit.available_norms():
        cls = get_norm(name)
        out[name] = (name, dict(cls.example_options))
        for variant in cls.example_variants:
            out[name + "".join(f"-{k}={v}" for k, v in variant.items())] = (name, {**cls.example_options, **variant})
    return out


def _built(norm: str, options: dict) -> Norm:
    return get_norm(norm)(make_options(norm, **options), AttentionShape(4, 2, 8, 64))


NORMS = _configurations()
# the configurations whose norm adds parameters (gradients must reach them), and those computed inside attention
# by retrofit's kernels (gradients must reach the queries through them)
WITH_PARAMETERS = [key for key, (norm, options) in NORMS.items() if _built(norm, options).has_parameters]
KERNELS = [key for key, (norm, options) in NORMS.items()
           if not get_norm(norm).baseline and not get_norm(norm).on_output(make_options(norm, **options))]
FAMILIES = list(TINY)  # gpt2, llama, mistral, qwen2, gemma, gemma2, phi3
MATRIX = [(f, n, nope) for f in FAMILIES for n in NORMS for nope in (False, True)]
IDS = [f"{f}-{n}-{'nope' if nope else 'pos'}" for f, n, nope in MATRIX]


def patched_pair(family, norm_key, nope, seed=0):
    """(original, patched) twins; the patched one's norm parameters are randomized (to catch head mix-ups)."""
    original = tiny_model(family, seed=seed)
    model = copy.deepcopy(original)
    model.config = copy.deepcopy(original.config)  # twins must not share a config (DESIGN.md)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config = model.config
    norm, options = NORMS[norm_key]
    retrofit.patch(model, norm, nope=nope, **options)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return original, model


@pytest.mark.parametrize("family,norm_key,nope", MATRIX, ids=IDS)
def test_parity_with_reference(family, norm_key, nope):
    original, model = patched_pair(family, norm_key, nope)
    reference = reference_model(original, model, nope)
    ids = random_ids(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row exercises the mask path
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = reference(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,norm_key,nope", MATRIX, ids=IDS)
def test_causal(family, norm_key, nope):
    _, model = patched_pair(family, norm_key, nope)
    ids = random_ids(1, 20)
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 5) % 90 + 3
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[0, :12], b[0, :12], atol=1e-6, rtol=0)
    assert (a[0, 12:] - b[0, 12:]).abs().max() > 1e-4  # the change is visible where it should be


@pytest.mark.parametrize("family,norm_key,nope", MATRIX, ids=IDS)
def test_kv_cache(family, norm_key, nope):
    _, model = patched_pair(family, norm_key, nope)
    ids = random_ids(1, 10)
    with torch.no_grad():
        full = model(ids).logits
        # prefill 6 tokens, then 3 tokens at once onto a non-empty cache, then 1
        out = model(ids[:, :6], use_cache=True)
        cache = out.past_key_values
        chunk = model(ids[:, 6:9], past_key_values=cache, use_cache=True)
        last = model(ids[:, 9:], past_key_values=chunk.past_key_values, use_cache=True)
    stepped = torch.cat([out.logits, chunk.logits, last.logits], 1)
    torch.testing.assert_close(stepped, full, atol=1e-4, rtol=1e-4)
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kw)
        recomputed = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("family,norm_key,nope", MATRIX, ids=IDS)
def test_left_padded_batch_equals_single(family, norm_key, nope):
    _, model = patched_pair(family, norm_key, nope)
    long, short = random_ids(1, 14, seed=3)[0], random_ids(1, 9, seed=4)[0]
    batch = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 5:], mask[1, 5:] = short, 1
    with torch.no_grad():
        together = model(input_ids=batch, attention_mask=mask).logits
        alone_long = model(long[None]).logits[0]
        alone_short = model(short[None]).logits[0]
    if nope or model.config.model_type != "gpt2":
        torch.testing.assert_close(together[0], alone_long, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together[1, 5:], alone_short, atol=1e-5, rtol=1e-5)
    else:  # GPT-2 takes absolute positions from the padded layout unless position_ids are given
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            together = model(input_ids=batch, attention_mask=mask, position_ids=pos).logits
        torch.testing.assert_close(together[1, 5:], alone_short, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norm_key", list(NORMS))
def test_unpatch_is_bitwise_original(family, norm_key):
    original, model = patched_pair(family, norm_key, nope=True)
    ids = random_ids()
    retrofit.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert not retrofit.is_patched(model) and not hasattr(model.config, "retrofit")
    assert model.config._attn_implementation == original.config._attn_implementation


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_norm_is_bitwise_original(family):
    original = tiny_model(family)
    model = tiny_model(family)
    retrofit.patch(model, "softmax")
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_the_matrix_keeps_what_it_checked_when_it_was_written_by_hand():
    """The lists are the registry's now; a norm that lost its parameters or its kernel would leave them silently, so
    what the hand-written lists held (issue 63) is a floor. A new norm needs no edit here."""
    assert {NORMS[key][0] for key in WITH_PARAMETERS} >= {"avnorm", "ssmax", "softmax1"}
    assert {NORMS[key][0] for key in KERNELS} >= {"psoftmax", "ssmax", "softmax1"}
    assert len(WITH_PARAMETERS) >= 5 and len(NORMS) >= 9


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("norm_key", WITH_PARAMETERS)
def test_gradients_reach_added_parameters(family, norm_key):
    _, model = patched_pair(family, norm_key, nope=False)
    model.train()
    ids = random_ids(2, 16)
    model(input_ids=ids, labels=ids).loss.backward()
    added = {n: p for n, p in model.named_parameters() if ".retrofit." in n}
    assert added, "the norm added no parameters"
    for name, p in added.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    # and the rest of the model still learns through the new attention
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("norm_key", KERNELS)
def test_gradients_reach_queries_through_the_kernels(family, norm_key):
    _, model = patched_pair(family, norm_key, nope=False)
    model.train()
    ids = random_ids(2, 16)
    model(input_ids=ids, labels=ids).loss.backward()
    q_grads = [p.grad for n, p in model.named_parameters() if "q_proj" in n or n.endswith("attn.c_attn.weight")]
    assert q_grads and all(g is not None and g.abs().sum() > 0 for g in q_grads)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("norm_key", list(NORMS))
def test_bf16_large_logits_finite(family, norm_key):
    _, model = patched_pair(family, norm_key, nope=False)
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # x10 on q and k projections = x100 on the attention logits
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj")) or name.endswith("attn.c_attn.weight"):
                p.mul_(10.0)
    model.train()
    ids = random_ids(2, 16)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), name


def test_gradient_checkpointing_matches_plain():
    _, model = patched_pair("llama", "avnorm", nope=False)
    twin = copy.deepcopy(model)
    model.train(), twin.train()
    from retrofit.train.model_setup import enable_gradient_checkpointing  # what `retrofit train` uses
    enable_gradient_checkpointing(twin)
    ids = random_ids(2, 16)
    model(input_ids=ids, labels=ids).loss.backward()
    twin(input_ids=ids, labels=ids).loss.backward()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=n)


def test_report_counts_modules_and_parameters():
    model = tiny_model("llama")
    report = retrofit.patch(model, "avnorm", kind="layer", affine=True)
    heads, dim, layers = 4, 8, 2
    assert len(report.modules) == layers
    assert report.params_added == layers * (heads + 2 * heads * dim)  # gain + weight + bias
    text = str(report)
    assert "llama" in text and "avnorm" in text and "kind=layer" in text and "(not calibrated)" in text
    assert model.config.retrofit["options"]["kind"] == "layer"


def test_patch_does_not_leak_into_a_model_sharing_the_config():
    a = tiny_model("llama", seed=0)
    b = copy.deepcopy(a)
    for m in b.modules():  # share one config object, as models built from one config do
        if hasattr(m, "config"):
            m.config = a.config
    ids = random_ids()
    with torch.no_grad():
        before = b(ids).logits
        retrofit.patch(a, "psoftmax", p=2.0)
        assert torch.equal(b(ids).logits, before)


def test_calibration_recovers_the_original_function():
    original = tiny_model("llama", seed=3)
    model = tiny_model("llama", seed=3)
    retrofit.patch(model, "avnorm")
    ids = random_ids(4, 32, seed=9)
    with torch.no_grad():
        want = original(input_ids=ids, labels=ids).loss
        unit = model(input_ids=ids, labels=ids).loss
        summary = retrofit.calibrate(model, [ids[:2], {"input_ids": ids[2:],
                                                       "attention_mask": torch.ones_like(ids[2:])}])
        calibrated = model(input_ids=ids, labels=ids).loss
    assert summary["tokens"] == ids.numel() and summary["batches"] == 2
    assert model.config.retrofit["calibration"]["tokens"] == ids.numel()
    assert abs(calibrated - want) < abs(unit - want)
    gains = torch.cat([m.retrofit.gain for m in model.modules() if hasattr(m, "retrofit")])
    assert not torch.allclose(gains, torch.ones_like(gains))


def test_calibration_gain_is_mean_head_rms():
    model = tiny_model("gpt2", seed=5)
    retrofit.patch(model, "avnorm")
    ids = random_ids(2, 12)
    seen = {}

    def spy(module, q, k, v, mask, scaling, norm):
        seen[module.layer_idx] = (q, k, v, scaling)

    with retrofit.observe(model, spy), torch.no_grad():
        model(ids)
    retrofit.calibrate(model, [ids])
    q, k, v, scaling = seen[0]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)  # (B,H,T,D)
    rms = out.pow(2).mean(-1).sqrt()  # (B, H, T): each head's output RMS per token
    normed_rms = (out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5)).pow(2).mean(-1).sqrt()
    # the gain makes the normalized head's mean RMS equal the original's (~ the mean RMS itself, up to eps)
    want = rms.mean((0, 2)) / normed_rms.mean((0, 2))
    torch.testing.assert_close(want, rms.mean((0, 2)), atol=0, rtol=0.05)
    got = model.transformer.h[0].attn.retrofit.gain
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_observe_sees_every_layer_on_unpatched_model():
    model = tiny_model("qwen2")
    calls = []
    with retrofit.observe(model, lambda m, q, k, v, mask, s, norm: calls.append((m.layer_idx, q.shape, norm))):
        model(random_ids())
    assert [c[0] for c in calls] == [0, 1] and all(c[2] is None for c in calls)
    assert model.config._attn_implementation == "sdpa"  # restored


def test_p_softmax_model_runs_under_inference_mode():
    """Evaluation runs under torch.inference_mode; the kernel's worker threads must inherit it
    (they once wrote into inference tensors from threads outside it and crashed)."""
    _, model = patched_pair("llama", "psoftmax", nope=False)  # p = 2, its example
    ids = random_ids(4, 300)
    with torch.no_grad():
        want = model(ids).logits
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel hands blocks to worker threads only with more than one
    try:
        with torch.inference_mode():
            got = model(ids).logits
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
