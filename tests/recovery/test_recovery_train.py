"""retrofit.recovery in training: a schedule + KL run closes the gap to the softmax control faster than plain CE on a
tiny pretrained Llama; kill mid-schedule + resume is bitwise the uninterrupted run; the final knob is recorded so
a reload is what was trained; the CLI probes; the example recipe's arms all load."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import retrofit
from retrofit.cli import main
from retrofit.load import load
from retrofit.recipe import PatchSection, load_recipe, recipe_from_dict
from retrofit.recovery.distill import teacher_mode
from retrofit.train import read_log, resume_state, train
from tests.tiny import TINY, random_ids
from tests.train.test_train import write_corpus

ROOT = Path(__file__).resolve().parents[2]
QUIET = {"progress": False, "log_every": 1}
TINY_LLAMA = {"model_type": "llama", **TINY["llama"]}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama pretrained for 150 steps on a 10-word language (~4 s): softmax is what it knows."""
    folder = write_corpus(tmp_path_factory.mktemp("recovery"))
    train(recipe_from_dict(_raw(folder, folder / "base", model={"config": TINY_LLAMA, "tokenizer": str(folder / "tok")},
                                patch={"norm": None}, train={"steps": 150, "lr": 1e-2})))
    return folder


def _raw(folder, out, *, model=None, patch=None, train=None, recovery=None, output=None) -> dict:
    raw = {"model": model or {"source": str(folder / "base")},
           "patch": patch or {"norm": "avnorm", "calibrate": 1024},
           "data": {"task": "lm", "files": [str(folder / "text.txt")], "seq_len": 32, "val_blocks": 4,
                    "cache_dir": str(folder / "cache")},
           "train": {"steps": 20, "batch_size": 8, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 2,
                     "weight_decay": 0.0, **QUIET, **(train or {})},
           "eval": {"batches": 2, "batch_size": 4, "at_steps": [0]},
           "output": {"dir": str(out), **(output or {})}}
    if recovery is not None:
        raw["recovery"] = recovery
    return raw


def test_schedule_and_kl_close_the_gap_to_the_control_faster_than_plain_ce(base, tmp_path):
    """Measured (20 steps at lr 1e-3): control 0.780; calibrated AVNorm + CE 0.832; the floor annealed 8 -> 0 over
    10 steps with KL 0.3: 0.811 (0.798 with the floor over 14 steps). Asserted with a margin: gap at most 0.6x."""
    def loss(name, **kw):
        return train(recipe_from_dict(_raw(base, tmp_path / name, **kw))).evals

    control = loss("control", patch={"norm": "softmax"})
    plain = loss("ce")
    recover = loss("recover", recovery={"kl_weight": 0.3, "schedule": {"steps": 10}})
    at = {name: {s: e["eval/loss@32"] for s, e in ev.items()} for name, ev in
          (("control", control), ("ce", plain), ("recover", recover))}
    assert abs(at["recover"][0] - at["control"][0]) < 2e-3 < at["ce"][0] - at["control"][0]  # starts at the original
    gap_plain, gap_recover = at["ce"][20] - at["control"][20], at["recover"][20] - at["control"][20]
    assert gap_recover < 0.6 * gap_plain and gap_plain > 0.02, at


def test_kill_mid_schedule_then_resume_is_bitwise_the_uninterrupted_run_and_a_reload_is_what_was_trained(
        base, tmp_path):
    recovery = {"schedule": {"steps": 8, "end": 0.25, "by_layer": True, "shape": "cosine"}, "kl_weight": 0.3,
                "match_steps": 2, "patch_lr": 1e-2, "patch_warmup_steps": 1}
    raw = _raw(base, tmp_path / "run", train={"steps": 10}, recovery=recovery, output={"save_every": 4})
    reference = train(recipe_from_dict(_raw(base, tmp_path / "full", train={"steps": 10}, recovery=recovery)))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    script = textwrap.dedent(f"""
        import os, signal
        from retrofit.recipe import load_recipe
        from retrofit.train import train
        def kill(event, step, info):
            if event == "step" and step == 7:
                os.kill(os.getpid(), signal.SIGKILL)   # mid-schedule: after the step-4 checkpoint
        train(load_recipe({str(tmp_path / 'r.yaml')!r}), callbacks=[kill])
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    [(step, ckpt)] = resume_state.complete_checkpoints(tmp_path / "run")
    meta = yaml.safe_load((ckpt / "meta.json").read_text())
    assert step == 4 and meta["knob"][0] < meta["knob"][1]  # by layer, mid-schedule: layer 0 ahead of layer 1
    groups = torch.load(ckpt / "optimizer.bin", weights_only=False)["param_groups"]
    assert {g["name"]: len(g["params"]) for g in groups} == {"decay": 15, "no_decay": 6, "patch": 2}
    resumed = train(recipe_from_dict(raw), resume=True)
    assert resumed.resumed_from == 4
    got = {r["step"]: r["loss"] for r in read_log(tmp_path / "run" / "log.jsonl") if "loss" in r}
    assert got == reference.losses  # bitwise: the same floats
    for (name, a), b in zip(resumed.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(a, b), name
    # the final knob is in config.retrofit, so a reload is exactly what was trained
    assert reference.model.config.retrofit["options"]["floor"] == 0.25
    ids = random_ids(2, 24)
    reloaded = load(tmp_path / "full")
    assert all(n.floor == 0.25 for n in reloaded.modules() if hasattr(n, "floor"))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, reference.model.eval()(input_ids=ids).logits)


def test_lora_teacher_is_the_original_model_and_psoftmax_gain_calibrates_from_the_recipe(base, tmp_path):
    result = train(recipe_from_dict(_raw(
        base, tmp_path / "p", patch={"norm": "psoftmax", "p": 2.0, "gain": 1.0},
        train={"steps": 2, "peft": {"r": 4, "save": "adapter"}},
        recovery={"kl_weight": 1.0, "lm_weight": 0.0, "schedule": {"steps": 2}, "calibrate": 512})))
    assert result.model.config.retrofit["calibration"]["tokens"] == 512
    original = retrofit.load.load(str(base / "base"))
    ids = random_ids(2, 24)
    model = result.model
    with torch.no_grad(), teacher_mode(model):
        teacher = model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(teacher, original(input_ids=ids).logits)  # patch bypassed and adapters off
        assert not torch.equal(model(input_ids=ids).logits, teacher)


def test_cli_probe_prints_losses_along_the_schedule_and_the_head_spread(base, capsys):
    text = str(base / "text.txt")
    assert main(["patch", str(base / "base"), "--norm", "avnorm", "--calibration-text", text, "--check-text", text,
                 "--check-tokens", "128", "--schedule-values", "0,0.5,1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"schedule position (\S+) \(avnorm knob (\S+)\): loss (\S+)", out)
    assert [(t, k) for t, k, _ in rows] == [("0", "8"), ("0.5", "4"), ("1", "0")]
    losses = [float(v) for _, _, v in rows]
    original, patched = (float(v) for v in re.search(r"original (\S+), patched (\S+) ", out).groups())
    assert losses[2] == patched  # position 1 is the plain patch
    assert abs(losses[0] - original) < 0.5 * abs(patched - original)  # position 0 is near the original
    assert re.search(r"per-head spread .*: mean 0\.\d+, max 0\.\d+ \(most changed by a per-token norm: L\d\.h\d", out)
    assert main(["patch", str(base / "base"), "--norm", "softmax", "--check-text", text,
                 "--schedule-values", "0,1"]) == 2
    assert "has no knob a schedule can move" in capsys.readouterr().err


def test_the_recovery_recipe_is_the_ablation_and_its_defaults_are_one_of_its_arms():
    """recipes/llama-recovery.yaml: nine arms adding one mechanism at a time, the same tokens per step; the
    top-level patch + recovery (what `retrofit train` runs) is exactly one measured arm's configuration."""
    recipe = load_recipe(ROOT / "recipes" / "llama-recovery.yaml")
    exp = recipe.section("experiment")
    assert [a.name for a in exp.arms] == ["softmax", "avnorm", "avnorm-plr", "avnorm-kl", "avnorm-match",
                                          "avnorm-floor", "avnorm-best", "psoftmax", "softmax1", "softmax-lr2e-4",
                                          "avnorm-kl-lr2e-4"]
    assert exp.control == "softmax" and exp.recovery_lengths == [512, 4096]
    assert [a.patch.norm for a in exp.arms] == ["softmax"] + ["avnorm"] * 6 + ["psoftmax", "softmax1", "softmax",
                                                                                "avnorm"]
    assert exp.arms[9].lr == exp.arms[10].lr == 2e-4  # the faster arm has a control at its own rate
    rec = {a.name: a.recovery for a in exp.arms}
    assert rec["softmax"] is None and rec["avnorm"] is None and rec["avnorm-plr"].patch_lr == 1e-2
    assert rec["avnorm-best"].distills() and rec["avnorm-best"].schedule.steps < exp.finetune_steps
    assert exp.arms[7].patch.options == {"p": 2.0, "gain": 1.0} and rec["psoftmax"].schedule is not None
    assert rec["softmax1"].schedule is not None and exp.arms[8].patch.options == {"sink": 0.0}
    assert len(_arms_the_defaults_are(recipe)) == 1


def _arms_the_defaults_are(recipe) -> list[str]:
    """The arms whose patch, recovery and effective rate are the recipe's top level (what `retrofit train` runs)."""
    exp = recipe.section("experiment")
    return [a.name for a in exp.arms if a.patch == recipe.patch and a.recovery == recipe.section("recovery")
            and (a.lr or exp.finetune_lr or recipe.train.lr) == recipe.train.lr]


def test_the_v2_recipe_pits_retrofits_against_finetuned_rope_baselines_at_one_rate():
    """recipes/llama-retrofit-v2.yaml (#17): the control, both RoPE baselines and the retrofits, every arm at the
    same rate and tokens; KL arms with a RoPE extension are allowed (their teacher is the original model); the
    defaults are exactly one arm's configuration."""
    recipe = load_recipe(ROOT / "recipes" / "llama-retrofit-v2.yaml")
    exp = recipe.section("experiment")
    arms = {a.name: a for a in exp.arms}
    assert list(arms) == ["softmax", "softmax-yarn", "softmax-dynamic", "avnorm", "avnorm-yarn", "ssmax-dynamic",
                          "psoftmax"]
    assert exp.control == "softmax" and arms["softmax"].patch == PatchSection(norm="softmax")
    assert {arms["softmax-yarn"].patch.rope, arms["softmax-dynamic"].patch.rope} == {"yarn:4", "dynamic:4"}
    assert all(a.lr is None for a in exp.arms) and exp.finetune_lr is None  # one rate: train.lr
    assert arms["avnorm"].recovery == arms["avnorm-yarn"].recovery and arms["avnorm"].recovery.distills()
    assert arms["ssmax-dynamic"].patch.options == {"scale": "beyond"}
    assert recipe.eval_lengths() == [512, 1024, 2048, 4096, 8192, 16384, 32768] and exp.eval_base is False
    assert len(_arms_the_defaults_are(recipe)) == 1


def test_experiment_arms_carry_their_own_recovery_and_report_the_gap_at_every_recovery_length(base, tmp_path):
    """An arm's `recovery` reaches its training run (its identity-start schedule makes step 0 the original model,
    unlike the plain AVNorm arm beside it); the curve is measured at every recovery length; the gap table is the arm
    minus the control at the same step."""
    from retrofit.experiment import driver
    from retrofit.experiment.report import gap_series, recovery_series
    raw = _raw(base, tmp_path / "unused", patch={"norm": None})
    raw["eval"] = {"batches": 1, "batch_size": 4}
    raw["recovery"] = {"kl_weight": 5.0}  # top level: not applied to any arm (each arm says its own)
    floor = {"patch_lr": 1e-2, "kl_weight": 0.3, "schedule": {"steps": 3, "start": 1.0e6}}
    raw["experiment"] = {"base_steps": 0, "finetune_steps": 4, "recovery_at": [0, 2], "recovery_lengths": [32, 64],
                         "eval_data": [str(base / "text.txt")], "eval_max_tokens": 128, "arms": [
                             {"name": "softmax", "patch": {"norm": "softmax"}},
                             {"name": "avnorm", "patch": {"norm": "avnorm", "calibrate": 1024}},
                             {"name": "avnorm-floor", "patch": {"norm": "avnorm", "calibrate": 1024},
                              "recovery": floor}]}
    raw["data"]["val_blocks"] = 4
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    results = driver.run_experiment(path, tmp_path / "out", progress=False)
    assert not any(a["failed"] for a in results["arms"].values())
    arms = tmp_path / "out" / "arms"
    assert load_recipe(arms / "avnorm-floor" / "recipe.yaml").section("recovery").schedule.start == 1.0e6
    assert load_recipe(arms / "avnorm" / "recipe.yaml").section("recovery") is None
    assert load_recipe(arms / "softmax" / "recipe.yaml").section("recovery") is None
    assert results["arms"]["avnorm-floor"]["settings"]["recovery"]["kl_weight"] == 0.3
    for n in (32, 64):
        curves = {name: dict(zip(*xy)) for name, xy in recovery_series(results, n).items()}
        assert set(curves) == {"softmax", "avnorm", "avnorm-floor"} and set(curves["softmax"]) == {0, 2, 4}
        assert curves["avnorm-floor"][0] == pytest.approx(curves["softmax"][0], abs=1e-4)  # the identity start
        assert abs(curves["avnorm"][0] - curves["softmax"][0]) > 1e-2  # calibrated AVNorm is not the original
        gaps = {name: dict(zip(*xy)) for name, xy in gap_series(results, n).items()}
        assert set(gaps) == {"avnorm", "avnorm-floor"}
        for name in gaps:
            for step, gap in gaps[name].items():
                assert gap == pytest.approx(curves[name][step] - curves["softmax"][step], abs=1e-12)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Recovery at 32 tokens" in report and "## Recovery at 64 tokens" in report
    assert "Gap to the control arm `softmax`" in report
    assert (tmp_path / "out" / "recovery.png").is_file() and (tmp_path / "out" / "recovery-64.png").is_file()


def test_bad_recovery_lengths_are_one_line(base, tmp_path):
    raw = _raw(base, tmp_path / "unused", patch={"norm": None})
    raw["experiment"] = {"recovery_lengths": [], "arms": [{"name": "softmax", "patch": {"norm": "softmax"}}]}
    with pytest.raises(retrofit.RetrofitError, match="recovery_lengths must be a non-empty list") as err:
        recipe_from_dict(raw)
    assert "\n" not in str(err.value)
