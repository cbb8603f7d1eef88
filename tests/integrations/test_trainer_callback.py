"""retrofit inside transformers' Trainer and TRL's SFTTrainer (issue 53): RetrofitCallback moves the norm's knob on
the recovery schedule, step by step, and evaluates loss by length; the documented recipe (patch -> calibrate ->
retrofit.peft_config -> SFTTrainer -> save_adapter) trains the patch with the adapter and reloads exactly."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import retrofit
from retrofit.errors import RetrofitError
from retrofit.integrations.trainer import RetrofitCallback
from retrofit.recovery.schedule import position_at, scheduled_value_at, scheduled_values
from tests.tiny import char_tokenizer, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEXT = "the cat sat on the mat and the dog ran far. " * 40


class KnobProbe(TrainerCallback):
    """Records the knob each update runs with (called after RetrofitCallback's on_step_begin)."""

    def __init__(self):
        self.knobs = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.knobs[state.global_step] = scheduled_values(model)


def _rows(n=16, length=24) -> Dataset:
    ids = random_ids(n, length, seed=2)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def _args(tmp_path, steps, **more) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                             disable_tqdm=True, **more)


def test_the_knob_follows_the_schedule_step_by_step_in_a_trainer_run(tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    probe = KnobProbe()
    schedule = {"steps": 4, "shape": "cosine"}
    trainer = Trainer(model=model, args=_args(tmp_path, 6, gradient_accumulation_steps=2), train_dataset=_rows(),
                      callbacks=[RetrofitCallback(schedule=schedule), probe])
    trainer.train()
    expected = {step: scheduled_value_at(position_at(step, 4), 1.0, 2.0, "cosine") for step in range(6)}
    assert {s: v[0] for s, v in probe.knobs.items()} == pytest.approx(expected)
    assert all(len(set(v)) == 1 for v in probe.knobs.values())  # every layer at the same knob
    assert expected[1] != expected[0] != expected[4]  # it moved, and ended at the norm's own p
    assert retrofit.patch_record(model)["options"]["p"] == 2.0  # recorded: a reload is what was trained


def test_the_length_evaluation_logs_loss_at_each_length(tmp_path):
    """Loss by length on held-out token ids, every N steps and at the end, into the log history and the callback's
    history; equal to retrofit.evaluate's own loss on the same windows."""
    from retrofit.evaluate.scoring import evaluate_lengths
    model = tiny_model("llama")
    retrofit.patch(model, "ssmax")
    held_out = random_ids(1, 200, seed=7)[0]
    callback = RetrofitCallback(eval_ids=held_out, eval_lengths=[16, 32], eval_every=2)
    trainer = Trainer(model=model, args=_args(tmp_path, 4), train_dataset=_rows(), callbacks=[callback])
    trainer.train()
    assert sorted(callback.history) == [2, 4]
    logged = [e for e in trainer.state.log_history if "eval_loss@16" in e]
    assert [e["step"] for e in logged] == [2, 4]
    model.eval()
    rows = evaluate_lengths(model, [held_out.tolist()], [16, 32], progress=False)
    assert callback.history[4] == {f"eval_loss@{r['length']}": pytest.approx(r["loss"]) for r in rows}


def test_bad_settings_are_one_line_before_training(tmp_path):
    with pytest.raises(RetrofitError, match="recovery.schedule.steps must be >= 1"):
        RetrofitCallback(schedule={"steps": 0})
    with pytest.raises(RetrofitError, match="eval_lengths"):
        RetrofitCallback(eval_ids=[1, 2, 3], eval_lengths=None)
    model = tiny_model("llama")
    retrofit.patch(model, "softmax")
    trainer = Trainer(model=model, args=_args(tmp_path, 2), train_dataset=_rows(),
                      callbacks=[RetrofitCallback(schedule={"steps": 2})])
    with pytest.raises(RetrofitError, match="has no knob a schedule can move"):
        trainer.train()
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    trainer = Trainer(model=model, args=_args(tmp_path, 2), train_dataset=_rows(),
                      callbacks=[RetrofitCallback(schedule={"steps": 5})])
    with pytest.raises(RetrofitError, match=r"schedule.steps 5 > the run's 2 steps"):
        trainer.train()


@pytest.mark.parametrize("schedule, message", [
    ({"steps": "2"}, r"^schedule.steps must be an integer, got '2'$"),
    ({"steps": 2, "stpes": 3}, r"^unknown recipe key schedule.stpes \(did you mean 'steps'\?\); valid keys in "
                               r"schedule: steps, start, end, shape, by_layer, costs$"),
    ({"steps": 2.5}, r"^schedule.steps must be an integer, got 2.5$"),
    ({"steps": True}, r"^schedule.steps must be an integer, got True$"),
    (["steps", 2], r"^schedule must be a mapping of recovery.schedule's keys .*got \['steps', 2\]$"),
])
def test_a_schedule_of_the_wrong_type_or_key_is_one_line_not_a_type_error(schedule, message):
    """Issue 61: RetrofitCallback(schedule={"steps": "2"}) reached `"2" >= 1`, an unknown key ScheduleSection(**...):
    raw TypeErrors. The schedule is checked as a recipe's is: RetrofitError (a ValueError), one line."""
    with pytest.raises(RetrofitError, match=message):
        RetrofitCallback(schedule=schedule)


def test_patch_peft_config_sft_trainer_save_adapter_reload(tmp_path):
    """The documented TRL recipe: the patch's parameters train with the adapter (retrofit.peft_config), the AVNorm
    floor moves to 0 on schedule, and save_adapter's folder reloads with retrofit.from_pretrained to equal logits."""
    trl = pytest.importorskip("trl", reason="TRL is in the test extra")
    from peft import LoraConfig
    tokenizer = char_tokenizer()
    tiny_model("llama").save_pretrained(tmp_path / "base")
    model = retrofit.load.load(str(tmp_path / "base"))  # any source; the adapter names it as its base
    retrofit.patch(model, "avnorm")
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :256]
    retrofit.calibrate(model, [{"input_ids": ids.reshape(8, 32)}])
    gains = {n: p.detach().clone() for n, p in model.named_parameters() if ".retrofit." in n}
    config = retrofit.peft_config(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                    task_type="CAUSAL_LM"))
    data = Dataset.from_dict({"text": [TEXT[i:i + 60] for i in range(0, 600, 60)]})
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=4, per_device_train_batch_size=2,
                         learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                         max_length=64, bf16=False)  # TRL's default is bf16 where the device has it, and the
    # trained model's forward keeps accelerate's autocast wrapper: fp32 here, for an exact comparison
    probe = KnobProbe()
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=config, callbacks=[RetrofitCallback(schedule={"steps": 2}), probe])
    trainer.train()
    assert [v[0] for _, v in sorted(probe.knobs.items())] == [8.0, 4.0, 0.0, 0.0]  # avnorm floor 8 -> 0
    trained = {n.replace(".modules_to_save.default", ""): p for n, p in trainer.model.named_parameters()
               if ".retrofit.modules_to_save." in n}
    assert trained and any(not torch.equal(p, gains[n.replace("base_model.model.", "")]) for n, p in trained.items())
    retrofit.load.save_adapter(trainer.model, tmp_path / "adapter")
    trainer.model.eval()
    probe_ids = random_ids(2, 12)
    with torch.no_grad():
        expected = trainer.model(input_ids=probe_ids).logits
        got = retrofit.from_pretrained(str(tmp_path / "adapter"))(input_ids=probe_ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
