"""What serving, calibration, recipes, patching and the reports ask a norm, they ask through its hooks (Norm in
retrofit/norms/base.py, docs/adding-a-norm.md's table): a toy norm registered here, with nothing outside this file
knowing it, is served or refused, calibrated, given its recipe default, stacked on a model's own query scaling and
made the reports' control by its hooks alone.

The toy acts on each head's output, y_h = level_h * o_h; its calibration records each head's largest |o_h| and fits
level_h = 1 / that (not the default gain), on rows of 1000 tokens."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import retrofit
from retrofit.errors import RetrofitError
from retrofit.norms import NORMS, Norm, available_norms, baseline_norm, get_norm, make_options
from retrofit.norms.base import option
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS = 1000
REFUSAL = "toy with servable=false is not served by vLLM: run it with retrofit.from_pretrained"


class Toy(Norm):
    name = "toy"
    summary = "each head's output times a per-head level"
    formula = "y_h = level_h * o_h"
    acts_on_output = True
    per_head = True
    serve_as = "outputs"
    calibrated_by_default = True

    @dataclass
    class Options:
        level: float = option(1.0, "the initial per-head level; retrofit.calibrate fits it")
        servable: bool = option(True, "false: the vLLM plugin refuses it")
        again: bool = option(False, "allow on models that already scale queries by position")

    def __init__(self, options, shape):
        super().__init__(options, shape)
        self.level = nn.Parameter(torch.full((shape.num_heads,), options.level))  # (H,)
        self.calibration = None

    @classmethod
    def calibrates(cls, options) -> bool:
        return True

    def calibrated_parameter(self) -> str:
        return "level"

    @classmethod
    def calibration_given(cls, given: dict) -> bool:
        return given.get("level") is not None

    def calibration_rows(self, rows: int) -> int:
        return ROWS

    def calibration_sums(self, device) -> list[torch.Tensor]:
        return [torch.zeros(self.shape.num_heads, dtype=torch.float64, device=device)]

    def add_calibration(self, sums, recorded, valid) -> None:
        sums[0] = torch.maximum(sums[0], (recorded * valid).amax((0, 1)).double())  # (H,) largest |o_h| so far

    def fit_calibration(self, sums) -> torch.Tensor:
        return 1.0 / sums[0]

    @classmethod
    def serve_refusal(cls, options, heads) -> str | None:
        return None if options.servable else REFUSAL

    @classmethod
    def stacks_query_scaling(cls, options) -> bool:
        return options.again

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) -> the same; while calibrating, records each token's max |o_h| (B, T, H) and changes nothing."""
        if self.calibration is not None:
            self.calibration.append(out.detach().abs().amax(-1))
            return out
        return (out.float() * self.level.float().view(-1, 1)).to(out.dtype)


@pytest.fixture
def toy(monkeypatch):
    """Toy in the registry for this test only (monkeypatch takes it out again)."""
    monkeypatch.setitem(NORMS, Toy.name, Toy)
    return Toy


def _saved_config(tmp_path, **options) -> dict:
    model = tiny_model("llama")
    retrofit.patch(model, "toy", **options)
    model.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


# ---- serving -------------------------------------------------------------------------------------------------------

def test_a_norm_is_served_as_its_serve_as_says(toy, tmp_path):
    """A checkpoint of a norm with a serve_as gets a plan: nothing in retrofit.serve lists the norms it serves."""
    from retrofit.serve.plan import serve_plan, served_norms

    plan = serve_plan(_saved_config(tmp_path))
    assert plan.norm == "toy" and plan.options["level"] == 1.0 and "toy" in served_norms()


def test_a_norm_refuses_serving_in_its_own_words(toy, tmp_path):
    from retrofit.serve.plan import serve_plan

    with pytest.raises(RetrofitError) as caught:
        serve_plan(_saved_config(tmp_path, servable=False), where="ckpt")
    assert str(caught.value) == f"ckpt: {REFUSAL}"


def test_a_norm_without_serve_as_is_refused_naming_those_served(toy, tmp_path, monkeypatch):
    from retrofit.serve.plan import serve_plan

    config = _saved_config(tmp_path)
    monkeypatch.setattr(Toy, "serve_as", None)
    with pytest.raises(RetrofitError, match=r"^ckpt: retrofit's vLLM plugin serves .*, not 'toy'; run it with"):
        serve_plan(config, where="ckpt")


def test_every_norm_serves_as_a_step_the_plugin_runs_or_says_why_not():
    """serve_as is one of the steps retrofit/serve/llama.py implements; a norm without one (p-softmax) says why in
    its serve_refusal, which is what the plugin answers."""
    from retrofit.serve.plan import SERVE_STEPS

    for name in available_norms():
        cls = get_norm(name)
        options = make_options(name, **cls.example_options)
        assert cls.serve_as in SERVE_STEPS or (cls.serve_as is None and cls.serve_refusal(options, None)), name


# ---- calibration and the recipe's default -----------------------------------------------------------------------

def test_calibrate_fits_what_the_norm_says_from_what_it_records(toy):
    """retrofit.calibrate sums what the toy records with its add_calibration and writes its fit_calibration into its
    calibrated_parameter: level_h = 1 / the largest |o_h| the original model gives on the text."""
    from retrofit.calibration import row_length

    ids = random_ids(2, 16)
    original, largest = tiny_model("llama"), []
    for layer in original.model.layers:  # each head's largest |output| in the original model, per layer: (H,)
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda _, args: largest.append(args[0].view(*args[0].shape[:2], 4, -1).abs().amax((0, 1, 3))))
    with torch.no_grad():
        original(input_ids=ids)
    model = tiny_model("llama")
    retrofit.patch(model, "toy")
    summary = retrofit.calibrate(model, ids)
    levels = [m.level.detach() for m in model.modules() if isinstance(m, Toy)]
    torch.testing.assert_close(torch.stack(levels), 1.0 / torch.stack(largest))
    assert summary["tokens"] == 32 and summary["level_max"] == pytest.approx(float(torch.stack(levels).max()))
    assert row_length(model) == ROWS  # the norm's own calibration_rows


def test_a_recipe_calibrates_by_default_unless_the_options_given_set_it(toy):
    """patch.calibrate_tokens defaults to 8192 for a norm calibrated_by_default on a pretrained model, and to 0 when
    the options given set what calibration would (Norm.calibration_given: the toy's level, AVNorm's gain)."""
    from retrofit.recipe.sections import PatchSection

    assert PatchSection(norm="toy").tokens_to_calibrate(pretrained=True) == 8192
    assert PatchSection(norm="toy", options={"level": 2.0}).tokens_to_calibrate(pretrained=True) == 0
    assert PatchSection(norm="toy").tokens_to_calibrate(pretrained=False) == 0
    assert PatchSection(norm="avnorm", options={"gain": 2.0}).tokens_to_calibrate(pretrained=True) == 0


# ---- patching: a model that already scales its queries by position ------------------------------------------------

def test_a_norm_says_whether_it_stacks_on_the_models_own_query_scaling(toy, monkeypatch):
    monkeypatch.setattr(Toy, "scales_queries_by_position", True)
    with pytest.raises(RetrofitError, match="already applies .* toy would scale its queries a second time"):
        retrofit.patch(tiny_model("llama4_text"), "toy")
    report = retrofit.patch(tiny_model("llama4_text"), "toy", again=True)
    assert "toy stacked on the model's own" in str(report)


# ---- the reports' control --------------------------------------------------------------------------------------------

def _results(**extra) -> dict:
    curve = {"toy": [3.0, 2.5], "avnorm": [3.5, 2.6], "softmax": [3.1, 2.0]}
    return {"arms": {arm: {"recovery": {"0": {"eval/loss@32": a}, "2": {"eval/loss@32": b}}}
                     for arm, (a, b) in curve.items()}, **extra}


def test_results_without_a_recorded_control_compare_with_the_baseline_norm(toy, monkeypatch):
    """A results.json written before `control` was recorded: the control arm is the one named after the baseline
    norm (Norm.baseline, asked through baseline_norm()); a recorded control wins."""
    from retrofit.experiment.report import gap_series, results_control
    from retrofit.norms.softmax import Softmax

    monkeypatch.setattr(Softmax, "baseline", False)
    monkeypatch.setattr(Toy, "baseline", True)
    assert baseline_norm() == "toy" and results_control(_results()) == "toy"
    gaps = gap_series(_results())
    assert set(gaps) == {"avnorm", "softmax"} and gaps["avnorm"][0] == [0, 2]
    assert gaps["avnorm"][1] == pytest.approx([0.5, 0.1]) and gaps["softmax"][1] == pytest.approx([0.1, -0.5])
    assert set(gap_series(_results(control="avnorm"))) == {"toy", "softmax"}


# ---- the guide's table -----------------------------------------------------------------------------------------------

def test_every_hook_in_the_guides_table_is_a_hook_of_norm():
    """docs/adding-a-norm.md's hook table names only what Norm has, so a reader who fills a hook fills a real one."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "adding-a-norm.md").read_text()
    table = guide.split("## 3.", 1)[1].split("## 4.", 1)[0]
    hooks = {re.sub(r"\(.*", "", name) for row in table.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert {"serve_as", "serve_refusal", "fit_calibration", "calibration_given", "stacks_query_scaling"} <= hooks
    assert sorted(h for h in hooks if not hasattr(Norm, h)) == []
