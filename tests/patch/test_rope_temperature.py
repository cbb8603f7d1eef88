"""SSMax under YaRN: one correction owns the logits' temperature (retrofit.rope.compose_temperature).

    pytest tests/patch/test_rope_temperature.py

transformers' YaRN multiplies cos and sin by its attention factor (0.1 ln(factor) + 1 = 1.1386 at x4), so every q.k
logit is scaled by its square at every position; SSMax multiplies the logits by its own f(n). Stacked, the two
corrections compound (SSMax-beyond on YaRN x4 at 16K: 1.077 x 1.296). Under SSMax the extension gets attention
factor 1, so the logits' scale is SSMax's alone; under any other norm YaRN keeps its own.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import retrofit
from retrofit.load.from_recipe import same_rope
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

L = 16


def _scaling(model) -> float:
    rotary = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert rotary
    return float(rotary[0].attention_scaling)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_yarn_under_ssmax_has_attention_factor_one_and_softmax_keeps_yarns():
    softmax, ssmax = tiny_model("llama", max_position_embeddings=L), tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(softmax, "softmax", rope="yarn:4")
    report = retrofit.patch(ssmax, "ssmax", scale="beyond", rope="yarn:4")
    assert _scaling(softmax) == pytest.approx(0.1 * math.log(4) + 1)  # transformers' own YaRN factor, 1.1386
    assert _scaling(ssmax) == 1.0
    assert ssmax.config.rope_parameters["attention_factor"] == 1.0
    assert "attention_factor" not in softmax.config.rope_parameters
    assert ssmax.config.retrofit["rope"]["temperature_owner"] == "ssmax"
    assert any("ssmax owns the logits' temperature" in note for note in report.notes)


def test_the_logits_scale_is_ssmaxs_alone():
    """Inside L SSMax-beyond's factor is exactly 1: the model must equal softmax under YaRN with attention factor 1,
    and differ from softmax under YaRN's own factor (the double correction this replaces)."""
    base = tiny_model("llama", max_position_embeddings=L)
    ids = random_ids(length=L)
    ssmax, plain_yarn, unit_yarn = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    retrofit.patch(ssmax, "ssmax", scale="beyond", rope="yarn:4")
    retrofit.patch(plain_yarn, "softmax", rope="yarn:4")
    retrofit.patch(unit_yarn, "softmax", rope="yarn:4,attention_factor=1")
    same = (_logits(ssmax, ids) - _logits(unit_yarn, ids)).abs().max()
    stacked = (_logits(ssmax, ids) - _logits(plain_yarn, ids)).abs().max()
    assert same < 1e-6 and stacked > 100 * max(float(same), 1e-6)  # tiny random weights: logits move ~1e-3


def test_an_attention_factor_given_is_kept_and_said():
    model = tiny_model("llama", max_position_embeddings=L)
    report = retrofit.patch(model, "ssmax", scale="beyond", rope="yarn:4,attention_factor=1.2")
    assert _scaling(model) == pytest.approx(1.2)
    assert "temperature_owner" not in model.config.retrofit["rope"]
    assert any("keeps the attention_factor 1.2 given" in note for note in report.notes)


def test_extend_rope_on_a_trained_ssmax_model_composes_and_reloads(tmp_path):
    """An arm trained with SSMax and no extension, evaluated under YaRN (the experiment's eval_variants): the same
    composition, kept through save and reload, and still the same rope as a plain 'yarn:4' request."""
    model = tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(model, "ssmax", ref_len=L)
    retrofit.extend_rope(model, "yarn:4")
    assert _scaling(model) == 1.0
    record = model.config.retrofit["rope"]
    assert record["temperature_owner"] == "ssmax" and same_rope(record, "yarn:4")
    assert not same_rope(record, "yarn:4,attention_factor=1.3")
    model.save_pretrained(tmp_path / "m")
    again = retrofit.from_pretrained(tmp_path / "m")
    assert _scaling(again) == 1.0 and again.config.retrofit["rope"]["temperature_owner"] == "ssmax"
    ids = random_ids(length=2 * L)
    torch.testing.assert_close(_logits(again, ids), _logits(model, ids))


def test_extend_rope_on_avnorm_keeps_yarns_factor():
    model = tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(model, "avnorm", kind="rms")
    retrofit.extend_rope(model, "yarn:4")
    assert _scaling(model) == pytest.approx(0.1 * math.log(4) + 1)
    assert "temperature_owner" not in model.config.retrofit["rope"]
