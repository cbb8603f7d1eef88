"""Floor schedules that end above 0 and move in the loss's units (issue #30 item 3): shape=loss spreads the zero-shot
probe's cost evenly over the steps; an avnorm floor may end at 1 or 2 and is recorded so a reload is what was trained.

    pytest tests/recovery/test_floor_schedule.py
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import retrofit
from retrofit.errors import RetrofitError
from retrofit.recipe import TrainSection, recipe_from_dict
from retrofit.recovery.schedule import (
    apply_schedule,
    loss_progress,
    record_schedule,
    scheduled_value_at,
    set_schedule_position,
)
from retrofit.train import run_checks
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _interp(costs, s):
    """The piecewise-linear cost at position s in [0, 1] of costs sampled evenly."""
    k = len(costs) - 1
    i = min(int(s * k), k - 1)
    return costs[i] + (s * k - i) * (costs[i + 1] - costs[i])


def _floor_cost(f):
    """A synthetic zero-shot cost of floor f, shaped like the SmolLM2 probe (+0.04 at f=4, +0.47 at f=1, +0.87 at 0)."""
    return 0.87 * math.exp(-0.7 * f)


def test_loss_shape_hits_the_endpoints_and_is_monotone():
    costs = [_floor_cost(8 - 7 * s / 8) for s in range(9)]  # the path 8 -> 1, probed at 9 positions
    ts = [i / 200 for i in range(201)]
    knobs = [scheduled_value_at(t, 8.0, 1.0, "loss", costs=costs) for t in ts]
    assert knobs[0] == 8.0 and knobs[-1] == 1.0  # exactly the requested endpoints
    assert all(b <= a for a, b in zip(knobs, knobs[1:]))  # the floor only falls
    assert knobs[100] < 8.0 - 0.5 * 7  # half the cost is reached past the path's midpoint (cost rises near 1)


def test_loss_shape_makes_equal_cost_steps():
    costs = [_floor_cost(8 - 8 * s / 16) for s in range(17)]  # 8 -> 0, probed at 17 positions
    steps = 10
    spent = [_interp(costs, loss_progress(i / steps, costs)) for i in range(steps + 1)]
    rises = [b - a for a, b in zip(spent, spent[1:])]
    assert max(rises) - min(rises) < 1e-12 and sum(rises) == pytest.approx(costs[-1] - costs[0])
    # against the true (smooth) curve, probed densely (65 positions): steps within 10% of each other, where a linear
    # floor's differ 10x or more
    dense = [_floor_cost(8 - 8 * s / 64) for s in range(65)]
    true = [_floor_cost(8 * (1 - loss_progress(i / steps, dense))) for i in range(steps + 1)]
    rises = [b - a for a, b in zip(true, true[1:])]
    assert max(rises) / min(rises) < 1.1
    linear = [_floor_cost(8 * (1 - i / steps)) for i in range(steps + 1)]
    linear_rises = [b - a for a, b in zip(linear, linear[1:])]
    assert max(linear_rises) / min(linear_rises) > 10


def test_loss_shape_holds_a_dip_and_falls_back_to_linear_on_a_flat_curve():
    assert loss_progress(0.5, [1.0, 1.0, 1.0]) == 0.5
    assert loss_progress(0.5, [1.0, 3.0, 2.0, 3.0]) == pytest.approx(1 / 6)  # the dip at 2/3 is held at 3
    assert loss_progress(1.0, [1.0, 3.0, 2.0, 3.0]) == pytest.approx(1 / 3)  # the cost is all spent by then
    with pytest.raises(RetrofitError, match="needs the zero-shot probe's costs"):
        loss_progress(0.5, None)


def _recipe(schedule: dict, steps=10):
    recipe = recipe_from_dict({"model": {"config": {"model_type": "llama", "hidden_size": 32}},
                               "patch": {"norm": "avnorm"}, "data": {"task": "counting"},
                               "recovery": {"schedule": schedule}})
    return dataclasses.replace(recipe, train=TrainSection(steps=steps))


def test_a_floor_ending_at_1_is_recorded_and_reloads_as_trained(tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    retrofit.calibrate(model, [random_ids(2, 24, seed=3)])
    recipe = _recipe({"steps": 4, "end": 1.0, "shape": "loss", "costs": [3.0, 3.1, 3.5, 4.2]})
    spec = recipe.section("recovery").schedule
    seen = [apply_schedule(model, spec, step)[0] for step in range(6)]
    assert seen[0] == 8.0 and seen[4:] == [1.0, 1.0] and all(b <= a for a, b in zip(seen, seen[1:]))
    record_schedule(model)
    assert model.config.retrofit["options"]["floor"] == 1.0
    floored = tiny_model("llama")
    retrofit.patch(floored, "avnorm", floor=1.0)
    floored.load_state_dict(model.state_dict())
    ids = random_ids(2, 24)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, floored(ids).logits)  # the end is the floor-1 patch, bitwise
    model.save_pretrained(tmp_path)
    reloaded = retrofit.from_pretrained(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_the_probe_gives_costs_a_loss_schedule_takes():
    from retrofit.recovery import schedule_losses
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    retrofit.calibrate(model, [random_ids(2, 24, seed=3)])
    rows = schedule_losses(model, random_ids(1, 32), [0, 0.25, 0.5, 0.75, 1], end=2.0)
    assert [r[1] for r in rows] == [8.0, 6.5, 5.0, 3.5, 2.0] and model.model.layers[0].self_attn.retrofit.floor == 2.0
    costs = [r[2] for r in rows]
    values = [set_schedule_position(model, t / 8, end=2.0, shape="loss", costs=costs)[0] for t in range(9)]
    assert values[0] == 8.0 and values[-1] == 2.0 and all(b <= a for a, b in zip(values, values[1:]))


@pytest.mark.parametrize("schedule, message", [
    ({"steps": 5, "end": -1.0}, r"^recovery.schedule.end -1: avnorm floor must be >= 0"),
    ({"steps": 5, "start": -2.0}, r"^recovery.schedule.start -2: avnorm floor must be >= 0"),
])
def test_an_endpoint_its_norm_refuses_is_one_line_before_training(schedule, message):
    with pytest.raises(RetrofitError, match=message) as err:  # as the recipe is read: before any model loads
        _recipe(schedule)
    assert "\n" not in str(err.value)
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    good = _recipe({"steps": 5})
    bad = dataclasses.replace(good.section("recovery").schedule, start=schedule.get("start"), end=schedule.get("end"))
    good.section("recovery").schedule = bad  # past the recipe's check: the training setup refuses it too
    with pytest.raises(RetrofitError, match=message):
        run_checks.check_recovery(model, good)
    with pytest.raises(RetrofitError, match=message):
        set_schedule_position(model, 0.5, start=schedule.get("start"), end=schedule.get("end"))


@pytest.mark.parametrize("schedule, message", [
    ({"steps": 5, "shape": "loss", "costs": [1.0]}, r"recovery.schedule.shape loss needs costs"),
    ({"steps": 5, "costs": [1.0, 2.0]}, r"recovery.schedule.costs shape the schedule .*set shape: loss"),
    ({"steps": 5, "shape": "loss", "costs": [1.0, float("nan")]}, r"recovery.schedule.costs must be finite"),
    ({"steps": 5, "shape": "loss", "costs": [1.0, 2.0], "by_layer": True}, r"by_layer moves one layer at a time"),
])
def test_bad_loss_schedules_are_one_line_errors(schedule, message):
    with pytest.raises(RetrofitError, match=message) as err:
        _recipe(schedule)
    assert "\n" not in str(err.value)


def test_the_cli_probe_prints_costs_for_a_floor_ending_at_2(tmp_path, capsys):
    from retrofit.cli import main
    from tests.tiny import char_tokenizer
    tiny_model("llama").save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 8)
    argv = ["patch", str(tmp_path / "m"), "--norm", "avnorm", "--calibration-text", str(text), "--check-text",
            str(text), "--check-tokens", "64", "--schedule-end", "2"]
    assert main([*argv, "--schedule-values", "0,0.5,1"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"schedule position (\S+) \(avnorm knob (\S+)\): loss (\S+)", out)
    assert [(t, k) for t, k, _ in rows] == [("0", "8"), ("0.5", "5"), ("1", "2")]
    costs = re.search(r"recovery.schedule.costs for shape: loss: \[(.*)\]", out).group(1)
    assert [float(c) for c in costs.split(", ")] == [float(v) for _, _, v in rows]
    assert main([*argv, "--schedule-values", "0,0.2,1"]) == 0  # not evenly spaced: no costs line to paste
    assert "recovery.schedule.costs" not in capsys.readouterr().out


def _run_raw(tmp_path, out):
    from tests.tiny import TINY
    from tests.train.test_train import write_corpus
    folder = tmp_path / "corpus"
    if not folder.is_dir():
        folder.mkdir()
        write_corpus(folder)
    return {"model": {"config": {"model_type": "llama", **TINY["llama"]}, "tokenizer": str(folder / "tok")},
           "patch": {"norm": "avnorm", "calibrate_tokens": 256},
           "data": {"task": "lm", "files": [str(folder / "text.txt")], "seq_len": 32, "val_blocks": 2,
                    "cache_dir": str(folder / "cache")},
           "train": {"steps": 5, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 1,
                     "progress": False, "log_every": 1},
           "eval": {"batches": 1, "batch_size": 2, "at_steps": [0, 1, 2, 3, 4, 5]},
           "recovery": {"schedule": {"steps": 4, "end": 1.0, "shape": "loss"}},
           "output": {"dir": str(out), "save_every": 2}}


def test_a_run_measures_the_costs_itself_and_ends_at_floor_1(tmp_path, capsys):
    from retrofit.recovery import scheduled_values
    from retrofit.train import train
    raw = _run_raw(tmp_path, tmp_path / "run")
    floors = {}

    def watch(event, step, info):
        if event == "eval":
            floors[step] = scheduled_values(info["model"])[0]

    result = train(recipe_from_dict(raw), callbacks=[watch])
    line = re.search(r"recovery.schedule.costs measured \(zero-shot, first training block\): \[(.*)\]",
                     capsys.readouterr().out)
    costs = [float(c) for c in line.group(1).split(", ")]
    assert len(costs) == 9 and max(costs) > costs[0]  # the path 8 -> 1 costs loss (barely: an untrained model)
    assert floors[0] == 8.0 and floors[4] == floors[5] == 1.0
    assert [floors[s] for s in range(4)] == [scheduled_value_at(s / 4, 8.0, 1.0, "loss", costs=costs) for s in range(4)]
    assert all(floors[s + 1] <= floors[s] for s in range(5))
    assert result.model.config.retrofit["options"]["floor"] == 1.0


def test_a_loss_schedule_without_costs_on_a_task_without_next_token_loss_is_refused():
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    with pytest.raises(RetrofitError, match=r"shape loss without costs measures next-token losses, but data.task is "
                                            r"counting: give recovery.schedule.costs"):
        run_checks.check_recovery(model, _recipe({"steps": 5, "shape": "loss"}))


def test_an_interrupted_loss_shaped_run_resumes_bitwise(tmp_path):
    """The costs are measured again on resume, on the model as set up (before the checkpoint loads): the same."""
    from retrofit.train import read_log, train
    reference = train(recipe_from_dict(_run_raw(tmp_path, tmp_path / "full")))

    def stop(event, step, info):
        if event == "step" and step == 3:
            raise KeyboardInterrupt  # after the step-2 checkpoint, mid-schedule

    raw = _run_raw(tmp_path, tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        train(recipe_from_dict(raw), callbacks=[stop])
    resumed = train(recipe_from_dict(raw), resume=True)  # refuses if the knob differs from the checkpoint's
    assert resumed.resumed_from == 2
    losses = {r["step"]: r["loss"] for r in read_log(tmp_path / "run" / "log.jsonl") if "loss" in r}
    assert losses == reference.losses
    for (name, a), b in zip(resumed.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(a, b), name
