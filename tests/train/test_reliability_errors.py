"""Reliability round 3 (errors): bad input that used to be a traceback, a 254 MB message or a wrong model.

A YAML alias bomb and a 1000-deep recipe are refused in one short line, fast; a full disk while checkpointing
is one line and the run resumes to the uninterrupted weights; a tokenizer whose ids exceed the model's
vocabulary is refused where train meets it. Tiny counting GPT-2 runs (under a second each). The CLI-level
cases (exit 2, one line, nothing left behind) are in tests/cli/test_bad_inputs.py, block `# round 3 (errors)`.
"""

from __future__ import annotations

import errno
import json
import math
import shutil
import time

import pytest
import torch
import yaml

import retrofit
from retrofit.atomic import MARKER
from retrofit.errors import RetrofitError, shown
from retrofit.experiment.driver import DEMO_RECIPE, run_experiment
from retrofit.load import load
from retrofit.recipe import load_recipe, recipe_from_dict
from retrofit.recipe.schema import MAX_VALUES, load_yaml
from retrofit.recovery import record_knob, set_knob_position
from retrofit.recovery.distill import kl_per_position
from retrofit.train import checkpoint, train
from tests.tiny import tiny_model
from tests.train.test_reliability import counting_recipe, weights
from tests.train.test_train import TINY_LLAMA, lm_recipe, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- item 6: YAML alias bomb -----------------------------------------------------------------------------------------

def alias_bomb(levels: int) -> str:
    """The 'billion laughs' recipe: each level a list of 9 aliases of the one before, under train.steps
    (9**levels values once written out; ~550 bytes at 9 levels)."""
    lines = ["train:", "  steps:", "    - &a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    lines += [f"    - &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [9, 10])
def test_an_alias_bomb_is_refused_fast_in_one_short_line(levels, tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels))
    assert path.stat().st_size < 700
    start = time.perf_counter()
    with pytest.raises(RetrofitError) as err:
        load_recipe(path)
    assert time.perf_counter() - start < 2
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    assert f"expands to more than {MAX_VALUES:,} values through its aliases" in message and str(path) in message


def test_a_self_referencing_alias_and_a_deep_recipe_are_one_line(tmp_path):
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("a: &a [*a]\ntrain: {steps: *a}\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("train:\n  steps: " + "[" * 1000 + "]" * 1000 + "\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(counting_recipe(tmp_path / "run")))
    for path in (cycle, deep):
        with pytest.raises(RetrofitError, match=r"nests deeper than 32 levels") as err:
            load_recipe(path)
        assert "\n" not in str(err.value)
    with pytest.raises(RetrofitError, match=r"override train.steps nests deeper"):
        load_recipe(plain, ["train.steps=" + "[" * 40 + "]" * 40])


def test_a_recipe_with_plain_anchors_still_loads(tmp_path):
    """Anchors are useful (one list shared by two keys): a few aliases load exactly as PyYAML reads them."""
    raw = {k: v for k, v in counting_recipe(tmp_path / "run").items() if k != "eval"}
    text = yaml.safe_dump(raw) + "eval:\n  batches: 1\n  lengths: &lengths [32, 64]\n" \
        "experiment:\n  recovery_lengths: *lengths\n  arms: [{name: softmax, patch: {norm: softmax}}]\n"
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    assert load_yaml(text, "x") == yaml.safe_load(text)
    recipe = load_recipe(path)
    assert recipe.eval.lengths == [32, 64] and recipe.section("experiment").recovery_lengths == [32, 64]


def test_values_echoed_in_errors_are_cut():
    huge = list(range(10**6))
    start = time.perf_counter()
    text = shown(huge)
    assert time.perf_counter() - start < 0.1 and text == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"
    assert len(shown("x" * 10**6)) <= 80 and len(shown([huge] * 3)) <= 80
    assert shown("abc") == "'abc'" and shown(-1) == "-1"
    with pytest.raises(RetrofitError) as err:
        recipe_from_dict({**counting_recipe("x"), "train": {"steps": huge}})
    assert len(str(err.value)) < 200 and "train.steps must be an integer, got [0, 1, 2" in str(err.value)


# ---- item 7: disk full while checkpointing ---------------------------------------------------------------------------

TORCH_WRITER_FULL = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                                 "data/0: file write failed")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    torch.set_num_threads(1)
    return weights(train(recipe_from_dict(counting_recipe(tmp_path_factory.mktemp("full") / "run"))).model)


@pytest.mark.parametrize("error", [TORCH_WRITER_FULL, OSError(errno.ENOSPC, "No space left on device")],
                         ids=["torch-writer", "enospc"])
def test_a_full_disk_while_checkpointing_is_one_line_and_the_run_resumes(error, uninterrupted, tmp_path, monkeypatch):
    real_write = checkpoint.write_state

    def full_at_step_8(accelerator, folder):
        real_write(accelerator, folder)  # files half there, as when the disk fills mid-write
        if folder.name.endswith("0000008"):
            raise error

    monkeypatch.setattr(checkpoint, "write_state", full_at_step_8)
    run = tmp_path / "run"
    with pytest.raises(RetrofitError) as err:
        train(recipe_from_dict(counting_recipe(run)))
    message = str(err.value)
    assert "\n" not in message and message.startswith("the disk is full: checkpoint step 8 could not be written")
    assert f"--resume {run}" in message
    assert [s for s, _ in checkpoint.complete_checkpoints(run)] == [4]
    assert not list((run / checkpoint.FOLDER).glob(".tmp-*"))  # its space is given back
    monkeypatch.setattr(checkpoint, "write_state", real_write)
    resumed = train(recipe_from_dict(counting_recipe(run)), resume=True)
    assert resumed.resumed_from == 4
    for name, value in weights(resumed.model).items():
        assert torch.equal(value, uninterrupted[name]), name


def test_another_runtime_error_while_checkpointing_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(accelerator, folder):
        raise RuntimeError("a bug, not a disk")
    monkeypatch.setattr(checkpoint, "write_state", broken)
    with pytest.raises(RuntimeError, match="a bug, not a disk"):
        train(recipe_from_dict(counting_recipe(tmp_path / "run")))


# ---- item 7: a tokenizer whose ids the model has no embedding for ---------------------------------------------------

def test_a_tokenizer_beyond_the_vocabulary_is_refused_before_training(tmp_path):
    """IndexError in the first forward before; now refused in setup, naming both sides (the eval side is a CLI case)."""
    corpus = write_corpus(tmp_path)
    raw = lm_recipe(corpus, tmp_path / "run")
    raw["model"]["config"] = {**TINY_LLAMA, "vocab_size": 16}
    with pytest.raises(RetrofitError, match=r"^the tokenizer \(model.tokenizer\) has token ids up to \d+ but the "
                                            r"model has 16 embedding rows \(vocab_size\)") as err:
        train(recipe_from_dict(raw))
    assert "\n" not in str(err.value) and not (tmp_path / "run" / "log.jsonl").exists()
    raw["model"]["config"] = {**TINY_LLAMA, "vocab_size": 97}  # the char tokenizer's ids all fit: it trains
    raw["output"]["dir"], raw["train"]["steps"] = str(tmp_path / "run-fits"), 2
    assert train(recipe_from_dict(raw)).model is not None


# ---- item 9: p-softmax gain + a schedule ending elsewhere than p --------------------------------------------------

def _psoftmax_model(p: float, gain: float):
    model = tiny_model("llama").eval()
    retrofit.patch(model, "psoftmax", p=p, gain=gain)
    with torch.no_grad():  # per-head gains apart, as calibration and training leave them
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.retrofit.gain.copy_(torch.tensor([0.3, 0.6, 1.7, 2.9]) * (i + 1))
    return model


IDS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("end", [1.5, 3.0, 1.0])
def test_a_psoftmax_gain_schedule_ending_elsewhere_reloads_to_the_trained_model(end, tmp_path):
    """The knob at the schedule's end `end` != the patch's p=2: the trained forward uses g^((end-1)/(p-1)). Before,
    config.retrofit recorded p=end and a reload applied the full g (logits off by ~0.07); now it is bitwise."""
    model = _psoftmax_model(2.0, 1.0)
    set_knob_position(model, 1.0, end=end)
    with torch.no_grad():
        trained = model(input_ids=IDS).logits
    record_knob(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, trained)  # settling changes nothing in memory
    assert model.config.retrofit["options"]["p"] == end
    model.save_pretrained(tmp_path / "m")
    reloaded = retrofit.from_pretrained(str(tmp_path / "m")).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, trained)


def test_a_trained_psoftmax_gain_schedule_reloads_bitwise(tmp_path):
    raw = counting_recipe(tmp_path / "run", steps=4, save_every=0)
    raw["patch"] = {"norm": "psoftmax", "p": 2.0, "gain": 0.8}
    raw["recovery"] = {"schedule": {"steps": 2, "end": 1.5}}
    result = train(recipe_from_dict(raw))
    reloaded = load(tmp_path / "run").eval()
    ids = IDS % 16
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids), result.model.eval()(input_ids=ids))


def test_psoftmax_p1_with_a_gain_refuses_a_moving_knob_in_one_line():
    model = _psoftmax_model(1.0, 1.0)
    with pytest.raises(RetrofitError, match=r"^psoftmax p=1 with a gain cannot move its p to 1.5: .*undefined at "
                                            r"p = 1; set patch.p > 1") as err:
        set_knob_position(model, 0.5, start=2.0)
    assert "\n" not in str(err.value)
    set_knob_position(model, 1.0)  # start 1 -> end 1: nothing moves, nothing divides
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=IDS).logits).all()
    plain = tiny_model("llama").eval()
    retrofit.patch(plain, "psoftmax", p=1.0)  # without a gain, p = 1 schedules like any p
    assert set_knob_position(plain, 0.5, start=2.0) == [1.5, 1.5]


# ---- low: KL with a teacher log-probability of -inf -----------------------------------------------------------------

def test_kl_with_a_teacher_that_rules_a_token_out_is_finite_and_exact():
    teacher = torch.log_softmax(torch.tensor([[0.0, 1.0, float("-inf")]]), -1)
    student_logits = torch.tensor([[0.5, 0.2, 0.1]], requires_grad=True)
    student = torch.log_softmax(student_logits, -1)
    kl = kl_per_position(teacher, student)
    p0, p1 = 1 / (1 + math.e), math.e / (1 + math.e)  # the teacher's two possible tokens
    s = torch.log_softmax(torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64), -1).tolist()
    expected = p0 * (math.log(p0) - s[0]) + p1 * (math.log(p1) - s[1])  # the -inf token adds 0 * log 0 = 0
    assert torch.isfinite(kl).all() and abs(kl.item() - expected) < 1e-6
    kl.sum().backward()
    assert torch.isfinite(student_logits.grad).all()
    naive = (teacher.exp() * (teacher - student)).sum(-1)  # the old form: NaN
    assert torch.isnan(naive).all()
    finite = torch.log_softmax(torch.tensor([[0.0, 1.0, -2.0]]), -1)  # elsewhere: exactly the usual sum
    assert torch.equal(kl_per_position(finite, student), (finite.exp() * (finite - student)).sum(-1))


# ---- item 10: an edited arm is trained again; tables label arms from their checkpoints ------------------------------

EXPERIMENT = ["experiment.base_steps=4", "experiment.finetune_steps=3", "experiment.recovery_at=[0]",
              "eval.lengths=[64]", "eval.batches=1", "eval.batch_size=4", "train.batch_size=4",
              "train.micro_batch_size=4", "train.warmup_steps=1", "train.log_every=3", "train.progress=false"]


def _arms(psoftmax: str) -> str:
    return ('experiment.arms=[{"name": "softmax", "patch": {"norm": "softmax"}}, '
            f'{{"name": "psoftmax", "patch": {{"norm": "psoftmax", {psoftmax}}}}}]')


def _finished_at(out, arm):
    return (out / "arms" / arm / "result.json").stat().st_mtime_ns


@pytest.fixture(scope="module")
def experiment_p2(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "run"
    torch.set_num_threads(1)
    run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 2.0')], progress=False)
    return out


def test_an_edited_arm_is_trained_again_and_reported_with_its_new_settings(experiment_p2, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(experiment_p2, out)  # a moved DIR: the arms still match their base by its place in DIR
    softmax, psoftmax = _finished_at(out, "softmax"), _finished_at(out, "psoftmax")
    capsys.readouterr()
    results = run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 3.0')], progress=False)
    printed = capsys.readouterr().out
    assert "arm psoftmax: its settings changed (patch.p: 2.0 -> 3.0); training it again" in printed
    assert _finished_at(out, "softmax") == softmax and _finished_at(out, "psoftmax") != psoftmax
    assert json.loads((out / "arms" / "psoftmax" / "config.json").read_text())["retrofit"]["options"]["p"] == 3.0
    assert results["arms"]["psoftmax"]["patch"]["p"] == 3.0 and not results["arms"]["psoftmax"]["failed"]
    assert "| psoftmax | p=3.0, norm=psoftmax |" in (out / "report.md").read_text()
    evaluated = {m["name"]: m["retrofit"] for m in results["evaluation"]["models"]}
    assert evaluated["psoftmax"]["options"]["p"] == 3.0  # evaluated again, not the p=2 results reused


def test_an_edited_arm_not_made_by_retrofit_is_refused_naming_the_change(experiment_p2, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(experiment_p2, out)
    (out / "arms" / "psoftmax" / MARKER).unlink()  # e.g. a folder the user put there
    before = {p: p.stat().st_mtime_ns for p in (out / "arms" / "psoftmax").rglob("*")}
    results = run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 3.0')], progress=False)
    assert results["arms"]["psoftmax"]["failed"].startswith(
        f"arm psoftmax: {out / 'arms' / 'psoftmax'} was trained with other settings (patch.p: 2.0 -> 3.0)")
    assert {p: p.stat().st_mtime_ns for p in (out / "arms" / "psoftmax").rglob("*")} == before


@pytest.mark.parametrize("change, named", [
    ("experiment.base_steps=5", "train.steps: 4 -> 5"),
    ('experiment.base_patch={"norm": "softmax", "nope": true}', "patch.nope: False -> True"),
])
def test_a_changed_base_is_refused_not_reused_under_its_arms(experiment_p2, tmp_path, change, named):
    """Every arm starts from the base, so a base trained with other settings is a new experiment: refused in one
    line naming the change, and nothing in DIR is touched."""
    out = tmp_path / "run"
    shutil.copytree(experiment_p2, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(RetrofitError) as err:
        run_experiment(DEMO_RECIPE, out, [*EXPERIMENT, _arms('"p": 2.0'), change], progress=False)
    assert str(err.value).startswith(f"{out / 'base'} was trained with other settings (") and named in str(err.value)
    assert "\n" not in str(err.value) and "pass a new --out" in str(err.value)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before

def test_tables_label_an_arm_from_its_checkpoint(tmp_path):
    """A psoftmax arm whose schedule ends at p=1.5 was trained (and is saved) as p=1.5: so it is labelled."""
    arm = ('experiment.arms=[{"name": "psoftmax", "patch": {"norm": "psoftmax", "p": 2.0, "gain": 1.0}, '
           '"recovery": {"schedule": {"steps": 2, "end": 1.5}, "calibrate": 0}}]')
    results = run_experiment(DEMO_RECIPE, tmp_path / "run", [*EXPERIMENT, arm], progress=False)
    assert results["arms"]["psoftmax"]["patch"]["p"] == 1.5  # the recipe says 2.0
    rows = [line for line in (tmp_path / "run" / "report.md").read_text().splitlines()
            if line.startswith("| psoftmax | ") and "norm=psoftmax" in line]
    assert rows and all("p=1.5" in row and "p=2.0" not in row for row in rows), rows
