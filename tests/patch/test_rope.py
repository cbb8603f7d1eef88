"""RoPE extension as a patch option: every rope type x {softmax, avnorm, ssmax-beyond} on tiny models.

    pytest tests/patch/test_rope.py

Tiny models are trained for L = 16 positions and run at up to 40, so every extension is exercised.
linear, yarn and llama3 give cos/sin that depend on the position only, so cached decoding and left padding
hold beyond L. dynamic and longrope recompute inv_freq from the largest position in each call
(transformers' `dynamic_rope_update`): a cached decode or a padded batch that crosses L differs from a
full forward by design, so those are checked within L (and the difference itself is pinned below).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import retrofit
from retrofit.rope import describe_rope, parse_rope
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: 1 thread is ~6x faster on the shared 2 cores

L = 16
LONGROPE = {"rope_type": "longrope", "factor": 4, "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [1.0, 2.0, 3.0, 4.0]}  # rotary dim 8 -> 4 numbers each
ROPES = {"linear": "linear:4", "dynamic": "dynamic:2", "yarn": "yarn:4",
         "llama3": "llama3:4,low_freq_factor=1,high_freq_factor=4", "longrope": LONGROPE}
NORMS = {"softmax": ("softmax", {}), "avnorm": ("avnorm", {"kind": "rms"}), "ssmax": ("ssmax", {"scale": "beyond"})}
FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "phi3"]
STATELESS = {"linear", "yarn", "llama3"}  # cos/sin depend on the position only


def supported(family, rope_key):
    return family != "phi3" or rope_key == "longrope"  # Phi3Config accepts only longrope (test below)


MATRIX = [(f, r, n) for f in FAMILIES for r in ROPES for n in NORMS if supported(f, r)]
IDS = [f"{f}-{r}-{n}" for f, r, n in MATRIX]
PAIRS = [(f, r) for f in FAMILIES for r in ROPES if supported(f, r)]


def tiny(family, seed=0):
    extra = {"original_max_position_embeddings": L} if family == "phi3" else {}
    return tiny_model(family, seed=seed, max_position_embeddings=L, **extra)


def rope_pair(family, rope_key, norm_key, seed=0):
    """(original, patched) twins with separate configs; added norm parameters randomized. Built once per
    combination; the patched one is handed out as a fresh copy, since dynamic RoPE keeps state across calls."""
    original, model = _built_pair(family, rope_key, norm_key, seed)
    return original, copy.deepcopy(model)


@functools.lru_cache(maxsize=None)
def _built_pair(family, rope_key, norm_key, seed):
    original = tiny(family, seed)
    model = copy.deepcopy(original)
    model.config = copy.deepcopy(original.config)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config = model.config
    norm, options = NORMS[norm_key]
    retrofit.patch(model, norm, rope=ROPES[rope_key], **options)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return original, model


def seq_length(rope_key):
    return 28 if rope_key in STATELESS else 14


@pytest.mark.parametrize("family,rope_key,norm_key", MATRIX, ids=IDS)
def test_causal(family, rope_key, norm_key):
    _, model = rope_pair(family, rope_key, norm_key)
    ids = random_ids(1, 40)
    changed = ids.clone()
    changed[0, 30:] = (changed[0, 30:] + 5) % 90 + 3
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[0, :30], b[0, :30], atol=1e-6, rtol=0)
    assert (a[0, 30:] - b[0, 30:]).abs().max() > 1e-4


@pytest.mark.parametrize("family,rope_key,norm_key", MATRIX, ids=IDS)
def test_kv_cache_decode_equals_full_forward(family, rope_key, norm_key):
    _, model = rope_pair(family, rope_key, norm_key)
    length = seq_length(rope_key)
    ids = random_ids(1, length)
    prefill = length - 10  # 18 (beyond L) or 4
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :prefill], use_cache=True)  # prefill, then 3 tokens at once, then one at a time
        logits, cache = [out.logits], out.past_key_values
        steps = [(prefill, prefill + 3)] + [(t, t + 1) for t in range(prefill + 3, length)]
        for start, end in steps:
            out = model(ids[:, start:end], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,rope_key,norm_key", MATRIX, ids=IDS)
def test_left_padded_batch_equals_single(family, rope_key, norm_key):
    _, model = rope_pair(family, rope_key, norm_key)
    length = seq_length(rope_key)
    long, short = random_ids(1, length, seed=3)[0], random_ids(1, length - 5, seed=4)[0]
    batch = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 5:], mask[1, 5:] = short, 1
    with torch.no_grad():
        together = model(input_ids=batch, attention_mask=mask).logits
        alone_long, alone_short = model(long[None]).logits[0], model(short[None]).logits[0]
    torch.testing.assert_close(together[0], alone_long, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[1, 5:], alone_short, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,rope_key", PAIRS)
def test_unpatch_restores_weights_config_and_rotary_bitwise(family, rope_key):
    original = tiny(family)
    model = tiny(family)
    rotary, config_before = model.model.rotary_emb, model.config.to_dict()
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    retrofit.patch(model, "avnorm", rope=ROPES[rope_key])
    ids = random_ids(2, 40)
    with torch.no_grad():
        model(ids)  # dynamic and longrope mutate their rotary buffers in forward: unpatch must not care
    assert model.model.rotary_emb is not rotary and model.config.to_dict() != config_before
    retrofit.unpatch(model)
    assert model.model.rotary_emb is rotary
    assert model.config.to_dict() == config_before
    state = model.state_dict()
    assert state.keys() == state_before.keys() and all(torch.equal(state[k], state_before[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


@pytest.mark.parametrize("family,rope_key,norm_key", MATRIX, ids=IDS)
def test_save_and_reload_reproduces_logits(family, rope_key, norm_key, tmp_path):
    original, model = rope_pair(family, rope_key, norm_key)
    model.save_pretrained(tmp_path)
    loaded = retrofit.from_pretrained(str(tmp_path))
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.config.retrofit == model.config.retrofit
    assert loaded.config.max_position_embeddings == model.config.max_position_embeddings
    retrofit.unpatch(loaded)  # the reloaded patch still knows the true originals
    assert loaded.config.rope_parameters == original.config.rope_parameters
    assert loaded.config.max_position_embeddings == L
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, original(ids).logits)


FACTOR_ONE = {"linear": "linear:1", "dynamic": "dynamic:4", "yarn": "yarn:1",
              "llama3": "llama3:1,low_freq_factor=1,high_freq_factor=4", "longrope": {
                  **LONGROPE, "factor": 1, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}}


@pytest.mark.parametrize("family,rope_key", PAIRS)
def test_factor_one_or_dynamic_within_L_is_bitwise_original(family, rope_key):
    original, model = tiny(family), tiny(family)
    retrofit.patch(model, "softmax", rope=FACTOR_ONE[rope_key])
    ids = random_ids(2, L)  # dynamic:4 changes nothing until a sequence passes L
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_extension_changes_the_model_beyond_L():
    original, model = tiny("llama"), tiny("llama")
    retrofit.patch(model, "softmax", rope="dynamic:4")
    ids = random_ids(1, 40)
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, original(ids).logits)


def test_dynamic_cached_decode_beyond_L_differs_from_full_forward():
    """A fact the evaluation relies on: dynamic NTK recomputes inv_freq as the sequence grows, so keys cached
    at a shorter length keep their old rotation. Evaluate dynamic with full forwards, not cached decoding."""
    _, model = rope_pair("llama", "dynamic", "softmax")
    ids = random_ids(1, 40)
    with torch.no_grad():
        short = model(ids[:, :20], use_cache=True).past_key_values.layers[0].keys  # (B, Hkv, 20, D)
        full = model(ids, use_cache=True).past_key_values.layers[0].keys[:, :, :20]
    assert torch.equal(short[:, :, 0], full[:, :, 0])  # position 0 is not rotated at all
    assert (short[:, :, 1:] - full[:, :, 1:]).abs().max() > 1e-3  # later keys: rotated with another base


def test_dynamic_depends_on_the_longest_call_so_far():
    """Another fact for evaluation: dynamic recomputes inv_freq only when a call is longer than every earlier
    one and resets only when a call is shorter than L, so a length between L and an earlier, longer call
    reuses that call's base. Evaluate each dynamic length on a freshly patched model (or in rising order)."""
    _, model = rope_pair("llama", "dynamic", "softmax")
    ids = random_ids(1, 40)
    with torch.no_grad():
        fresh = model(ids[:, :24]).logits
        model(ids)
        after_long = model(ids[:, :24]).logits
        model(ids[:, :8])  # shorter than L: back to the original inv_freq
        after_reset = model(ids[:, :24]).logits
    assert not torch.equal(fresh, after_long) and torch.equal(fresh, after_reset)


def test_config_values_follow_transformers():
    model = tiny("llama")
    report = retrofit.patch(model, "softmax", rope="yarn:4,original=16,beta_fast=16")
    params = model.config.rope_parameters
    assert params == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                      "original_max_position_embeddings": 16}
    assert model.config.max_position_embeddings == 64 and report.rope == "yarn x4 (orig 16)"
    assert model.config.retrofit["rope"]["original"] == {"max_position_embeddings": 16, "rope_parameters": {
        "rope_theta": 10000.0, "rope_type": "default"}}
    dynamic = tiny("llama")
    retrofit.patch(dynamic, "softmax", rope="dynamic:4")
    assert dynamic.config.max_position_embeddings == L  # transformers' dynamic NTK starts at max_position_embeddings


def test_gemma3_extends_global_layers_only():
    pytest.importorskip("transformers.models.gemma3")
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma3 import Gemma3TextConfig
    cfg = Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, max_position_embeddings=L, vocab_size=97,
                           sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    before, rotary = copy.deepcopy(model.config.to_dict()), model.model.rotary_emb
    ids = random_ids(1, 40)
    with torch.no_grad():
        want = model(ids).logits
    retrofit.patch(model, "avnorm", rope="linear:4")
    new = model.model.rotary_emb
    assert model.config.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert model.config.rope_parameters["sliding_attention"] == before["rope_parameters"]["sliding_attention"]
    assert torch.equal(new.sliding_attention_inv_freq, rotary.sliding_attention_inv_freq)
    torch.testing.assert_close(new.full_attention_inv_freq, rotary.full_attention_inv_freq / 4, rtol=1e-6, atol=0)
    retrofit.unpatch(model)
    assert model.model.rotary_emb is rotary and model.config.to_dict() == before
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


# ---- the string grammar and the table description ----------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("yarn:4", {"rope_type": "yarn", "factor": 4.0}),
    ("dynamic:2", {"rope_type": "dynamic", "factor": 2.0}),
    ("Linear:2.5", {"rope_type": "linear", "factor": 2.5}),
    ("yarn:4,original=8192", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}),
    ("yarn:4, beta_fast=16, truncate=false", {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                              "truncate": False}),
    ("llama3:8,low_freq_factor=1,high_freq_factor=4",
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
])
def test_parse_rope(text, want):
    assert parse_rope(text) == want


def test_describe_rope():
    model = tiny("llama")
    retrofit.patch(model, "softmax", rope="yarn:4")
    assert describe_rope(model.config.retrofit) == "yarn x4 (orig 16)"
    assert describe_rope(model.config.retrofit["rope"]) == "yarn x4 (orig 16)"
    assert describe_rope("yarn:4,original=8192") == "yarn x4 (orig 8192)"
    assert describe_rope("dynamic:2") == "dynamic x2" and describe_rope(None) == "none"


# ---- bad input: one line each, and the model is left untouched ----------------------------------------

@pytest.mark.parametrize("rope,match", [
    ("yarm:4", "unknown rope type 'yarm' .*did you mean 'yarn'"),
    ("yarn:0", "factor must be >= 1 .*got 0.0"),
    ("yarn:-2", "factor must be >= 1 .*got -2.0"),
    ("yarn:abc", "factor must be a number, got 'abc'"),
    ("yarn", "has no factor"),
    ({"rope_type": "yarn", "factor": "4"}, "factor must be a number"),
    ({"rope_type": "yarn", "factor": True}, "factor must be a number"),
    ("yarn:4,beta_fats=16", "no key 'beta_fats' .*did you mean 'beta_fast'"),
    ("linear:4,original=8192", "rope type 'linear' has no key 'original_max_position_embeddings'"),
    ("yarn:4,original=10.5", "original_max_position_embeddings must be an integer >= 2, got 10.5"),
    ({"rope_type": "yarn", "factor": 4, "beta_fast": "x"}, "rope yarn beta_fast must be a number, got 'x'"),
    ("yarn:4,truncate=1", "truncate must be true or false"),
    ("llama3:8", "needs high_freq_factor and low_freq_factor: e.g. llama3:8,high_freq_factor=...,low_freq_factor"),
    ("longrope:4", "needs long_factor and short_factor: pass a dict"),
    ({**LONGROPE, "long_factor": [1.0, 2.0]}, "long_factor must be a list of 4 numbers"),
    (42, "rope must be a string"),
])
def test_bad_rope_input(rope, match):
    model = tiny("llama")
    before = model.config.to_dict()
    with pytest.raises(retrofit.RetrofitError, match=match) as err:
        retrofit.patch(model, "avnorm", rope=rope)
    assert "\n" not in str(err.value)
    assert not retrofit.is_patched(model) and model.config.to_dict() == before


def test_rope_type_missing_from_transformers(monkeypatch):
    import retrofit.rope
    monkeypatch.delitem(retrofit.rope.ROPE_INIT_FUNCTIONS, "llama3")
    with pytest.raises(retrofit.RetrofitError, match="'llama3' is missing from the installed transformers"):
        retrofit.patch(tiny("llama"), "softmax", rope="llama3:8,low_freq_factor=1,high_freq_factor=4")


@pytest.mark.parametrize("make,kwargs,match", [
    (lambda: tiny_model("gpt2"), {}, "gpt2 has learned absolute positions .* use nope=True"),
    (lambda: tiny("llama"), {"nope": True}, "rope and nope together"),
    (lambda: tiny("phi3"), {}, "Phi3Config refuses rope yarn x4"),
    (lambda: tiny_model("llama", rope_parameters={"rope_type": "linear", "factor": 2.0}), {},
     "already extends RoPE .*'linear'"),
])
def test_models_rope_cannot_extend(make, kwargs, match):
    model = make()
    with pytest.raises(retrofit.RetrofitError, match=match) as err:
        retrofit.patch(model, "softmax", rope="yarn:4", **kwargs)
    assert "\n" not in str(err.value) and not retrofit.is_patched(model)
