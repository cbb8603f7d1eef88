"""SSMax that leaves the trained context alone: scale=beyond and scale=llama4 are the original model, bitwise,
for every query position < L, and differ beyond it.

    pytest tests/norms/test_ssmax_beyond.py
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import retrofit
from retrofit.norms import AttentionShape, make_options
from retrofit.norms.ssmax import SSMax
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: 1 thread is ~6x faster on the shared 2 cores

L = 16
FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "phi3"]
SCALES = ["beyond", "llama4"]


def tiny(family, **overrides):
    extra = {"original_max_position_embeddings": L} if family == "phi3" else {}
    return tiny_model(family, max_position_embeddings=L, **extra, **overrides)


def patched(family, scale, **patch_kwargs):
    original = tiny(family)
    model = copy.deepcopy(original)
    model.config = copy.deepcopy(original.config)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config = model.config
    retrofit.patch(model, "ssmax", scale=scale, **patch_kwargs)
    return original, model


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("family", FAMILIES)
def test_bitwise_inside_L_different_beyond(family, scale):
    original, model = patched(family, scale)
    ids = random_ids(2, 40)
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
    assert torch.equal(got[:, :L], want[:, :L])
    assert (got[:, L:] - want[:, L:]).abs().amax(-1).min() > 1e-6  # every position beyond L moves


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_kv_cache_and_left_padding(family, scale):
    _, model = patched(family, scale)
    ids = random_ids(1, 30)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :18], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(18, 30):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
        torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-5, rtol=1e-5)
        short = random_ids(1, 24, seed=4)[0]  # beyond L: n must count the real keys, not the padding
        batch, mask = torch.zeros(2, 30, dtype=torch.long), torch.zeros(2, 30, dtype=torch.long)
        batch[0], mask[0] = ids[0], 1
        batch[1, 6:], mask[1, 6:] = short, 1
        together = model(input_ids=batch, attention_mask=mask).logits
        torch.testing.assert_close(together[1, 6:], model(short[None]).logits[0], atol=1e-5, rtol=1e-5)


def test_L_defaults_to_the_original_positions_when_rope_extends():
    base = tiny("llama")  # SSMax owns the logits' temperature: YaRN's attention factor is 1 under it (rope.py)
    retrofit.patch(base, "softmax", rope="yarn:4,attention_factor=1")
    _, model = patched("llama", "beyond", rope="yarn:4")
    assert model.config.max_position_embeddings == 4 * L
    ids = random_ids(2, 40)
    with torch.no_grad():
        want, got = base(ids).logits, model(ids).logits
    assert torch.equal(got[:, :L], want[:, :L])  # L = 16 (the original), not the raised 64
    assert (got[:, L:] - want[:, L:]).abs().max() > 1e-6


def test_explicit_ref_len():
    original, model = patched("qwen2", "beyond", ref_len=24)
    ids = random_ids(1, 40)
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
    assert torch.equal(got[:, :24], want[:, :24]) and not torch.equal(got[:, 24:], want[:, 24:])


def test_factor_formulas():
    shape = AttentionShape(4, 2, 8, L)
    n = torch.arange(1, 300, dtype=torch.float32)
    beyond = SSMax(make_options("ssmax", scale="beyond"), shape).factor(n)
    llama4 = SSMax(make_options("ssmax", scale="llama4"), shape).factor(n)
    assert torch.equal(beyond[:L], torch.ones(L)) and torch.equal(llama4[:L], torch.ones(L))
    assert beyond[L * L - 1].item() == pytest.approx(2.0)  # log(L^2) / log L
    assert llama4[L].item() == pytest.approx(1 + 0.1 * math.log(2))  # n = L + 1: position L, floor(L / L) = 1
    assert llama4[2 * L].item() == pytest.approx(1 + 0.1 * math.log(3))
    strong = SSMax(make_options("ssmax", scale="llama4", beta=0.5), shape).factor(n)
    assert strong[L].item() == pytest.approx(1 + 0.5 * math.log(2))


def test_learned_stays_the_default_and_the_others_add_no_parameters():
    model = tiny("llama")
    retrofit.patch(model, "ssmax")
    assert model.config.retrofit["options"]["scale"] == "learned"
    assert any(".retrofit.s" in n for n, _ in model.named_parameters())
    for scale in SCALES:
        report = retrofit.patch(tiny("llama"), "ssmax", scale=scale)
        assert report.params_added == 0


def test_reload_beyond(tmp_path):
    _, model = patched("gemma2", "llama4", beta=0.3)
    model.save_pretrained(tmp_path)
    loaded = retrofit.from_pretrained(str(tmp_path))
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.config.retrofit["options"] == model.config.retrofit["options"]


@pytest.mark.parametrize("options,match", [
    ({"scale": "beyon"}, "scale must be one of .*did you mean 'beyond'"),
    ({"scale": "beyond", "s_init": 0.3}, "s_init applies to scale=learned only"),
    ({"scale": "learned", "beta": 0.1}, "beta applies to scale=llama4 only"),
    ({"scale": "llama4", "beta": "x"}, "beta must be a number"),
    ({"scale": "beyond", "ref_len": 1}, "ref_len must be an integer >= 2"),
])
def test_bad_options(options, match):
    with pytest.raises(retrofit.RetrofitError, match=match) as err:
        retrofit.patch(tiny("llama"), "ssmax", **options)
    assert "\n" not in str(err.value)


def _build(model_type, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=97, **extra)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_refused_on_models_that_already_scale_queries_by_position():
    pytest.importorskip("transformers.models.ministral3")
    model = _build("ministral3", head_dim=8)
    for scale in ("learned", "beyond"):
        with pytest.raises(retrofit.RetrofitError, match="llama_4_scaling_beta.*pass stack=True") as err:
            retrofit.patch(model, "ssmax", scale=scale)
        assert "\n" not in str(err.value) and not retrofit.is_patched(model)
    retrofit.patch(model, "ssmax", scale="beyond", stack=True)
    assert retrofit.is_patched(model)


def test_llama4_temperature_tuning_is_detected():
    from retrofit.families import position_query_scaling
    pytest.importorskip("transformers.models.llama4")
    from transformers import Llama4TextConfig
    tuned = Llama4TextConfig(no_rope_layers=[1, 0], num_hidden_layers=2)
    assert "attn_temperature_tuning" in position_query_scaling(tuned)
    assert position_query_scaling(Llama4TextConfig(no_rope_layers=[1, 1], num_hidden_layers=2)) is None
    assert position_query_scaling(Llama4TextConfig(no_rope_layers=[1, 0], num_hidden_layers=2,
                                                   attn_temperature_tuning=False)) is None
