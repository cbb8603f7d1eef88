"""The training bar's s/step and the log's tokens/s count training only (issue 62, item 6): evaluations and checkpoint
saves, the final ones included, are left out, and a resumed run's rate starts at its resumed step. Time is a clock the
test moves by hand (progress.py reads its perf_counter): a step takes 2 s, an evaluation 1000 s, a checkpoint 500 s,
so every figure is exact and nothing waits. Tiny counting GPT-2 runs."""

from __future__ import annotations

import io
import re

import pytest
import torch

from retrofit.recipe import recipe_from_dict
from retrofit.train import loop, progress, resume_state, train
from tests.train.test_checkpoints import Killed, counting_recipe, kill_at

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STEP_S, EVAL_S, SAVE_S = 2.0, 1000.0, 500.0
TOKENS_PER_STEP = 4 * 32  # counting_recipe: batch_size 4 x seq_len 32


@pytest.fixture
def hand_clock(monkeypatch):
    """The clock progress.py reads, moved only by a step, an evaluation or a checkpoint save (each wrapped here)."""
    now = [0.0]
    monkeypatch.setattr(progress, "perf_counter", lambda: now[0])

    def taking(seconds, fn):
        def timed(*args, **kwargs):
            now[0] += seconds
            return fn(*args, **kwargs)
        return timed

    monkeypatch.setattr(loop, "train_step", taking(STEP_S, loop.train_step))
    monkeypatch.setattr(loop, "validation_metrics", taking(EVAL_S, loop.validation_metrics))
    monkeypatch.setattr(resume_state, "save_checkpoint", taking(SAVE_S, resume_state.save_checkpoint))
    return now


def _last_seconds_per_step(err: str) -> float:
    """The training bar's last s/step (its closing line: tqdm's mean over the run)."""
    shown = re.findall(r"([\d.]+)s/step", err)
    assert shown, err[-800:]
    return float(shown[-1])


def test_s_per_step_and_tokens_per_s_leave_evaluations_and_checkpoints_out(hand_clock, tmp_path, capsys):
    """4 steps of 2 s with an evaluation and a checkpoint after every second one (and an evaluation before the first):
    the bar closes at 2.00 s/step, not (8 + 2 x 1000 + 2 x 500) / 4, and every log window is 2 steps in 4 s."""
    raw = counting_recipe(tmp_path / "run", steps=4, save_every=2, log_every=2, progress=True)
    raw["eval"] |= {"every": 2, "at_steps": [0]}
    logged = []
    result = train(recipe_from_dict(raw), callbacks=[
        lambda event, step, info: logged.append(info["metrics"]["tokens_per_s"]) if event == "step" else None])
    assert sorted(result.evals) == [0, 2, 4]  # the evaluations (and so their 1000 s) did happen
    assert _last_seconds_per_step(capsys.readouterr().err) == pytest.approx(STEP_S)
    assert logged == [pytest.approx(2 * TOKENS_PER_STEP / (2 * STEP_S))] * 2


def test_a_resumed_runs_rate_starts_at_its_resumed_step(hand_clock, tmp_path, capsys):
    """Killed after the checkpoint at step 2 and resumed: the bar shows steps 3..4 over their 4 s (2.00 s/step), not
    4 steps over them (1.00 s/step, what counting from step 0 would show), nor the checkpoint and evaluation."""
    raw = counting_recipe(tmp_path / "run", steps=4, save_every=2, log_every=2, progress=True)
    raw["eval"] |= {"every": 2}
    with pytest.raises(Killed):
        train(recipe_from_dict(raw), callbacks=[kill_at("checkpoint", 2)])
    capsys.readouterr()
    logged = []
    resumed = train(recipe_from_dict(raw), resume=True, callbacks=[
        lambda event, step, info: logged.append(info["metrics"]["tokens_per_s"]) if event == "step" else None])
    assert resumed.resumed_from == 2 and sorted(resumed.evals) == [4]
    assert _last_seconds_per_step(capsys.readouterr().err) == pytest.approx(STEP_S)
    assert logged == [pytest.approx(2 * TOKENS_PER_STEP / (2 * STEP_S))]


def test_the_bar_reads_its_rate_and_eta_off_the_clock(monkeypatch):
    """step_bar alone: resumed at 6 of 10, two 3 s steps around a 1000 s pause show 3.00 s/step and, 2 steps left,
    an ETA of 00:06; so does the line the bar closes with."""
    now = [100.0]
    monkeypatch.setattr(progress, "perf_counter", lambda: now[0])
    clock = progress.StepClock()
    out = io.StringIO()
    bar = progress.step_bar(clock, total=10, initial=6, unit="step", file=out, mininterval=0)
    now[0] += 3.0
    bar.update(1)
    with clock.paused(torch.device("cpu")):
        now[0] += 1000.0
    now[0] += 3.0
    bar.update(1)
    assert bar.format_dict["rate"] == pytest.approx(1 / 3.0)
    shown = str(bar)
    bar.close()
    assert "8/10" in shown and "3.00s/step" in shown and "<00:06" in shown, shown
    assert "3.00s/step" in out.getvalue().rsplit("\r", 1)[-1]  # the closing line too (tqdm's mean rate there)
