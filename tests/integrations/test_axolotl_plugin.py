"""The axolotl plugin (issue 53): its hooks, called as axolotl's PluginManager calls them, patch, calibrate, add the
recovery callback and leave a saved model (full or LoRA) that retrofit.from_pretrained and, after the plugin's
pre_model_load, AutoModelForCausalLM load exactly. axolotl itself is not installed here (it pins transformers 5.16
and peft 0.20, below retrofit's): the hooks are called directly with a DictDefault-like config."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from datasets import Dataset
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import retrofit
from retrofit.errors import RetrofitError
from retrofit.integrations.axolotl import RetrofitPlugin
from retrofit.integrations.trainer import RetrofitCallback
from tests.tiny import char_tokenizer, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEXT = "the cat sat on the mat and the dog ran far. " * 40


class Cfg(dict):
    """axolotl's DictDefault as plugins see it: keys as attributes, a missing one is None."""

    def __getattr__(self, key):
        return self.get(key)


@pytest.fixture
def plugin():
    yield RetrofitPlugin()
    retrofit.disable()  # pre_model_load turned load-by-path on for this process


@pytest.fixture
def base(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "base")
    char_tokenizer().save_pretrained(tmp_path / "base")
    (tmp_path / "book.txt").write_text(TEXT)
    return tmp_path


def _train(model, callbacks, out):
    ids = random_ids(8, 24, seed=2)
    args = TrainingArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, callbacks=callbacks,
                      train_dataset=Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}))
    return trainer


def _logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=random_ids(2, 12)).logits


def test_the_input_args_are_axolotls_pydantic_model_and_check_their_values(plugin):
    module, name = plugin.get_input_args().rsplit(".", 1)
    args = getattr(importlib.import_module(module), name)
    assert args(retrofit_patch="avnorm:kind=rms", retrofit_recovery={"steps": 10}).retrofit_calibration_tokens == 8192
    with pytest.raises(ValidationError, match="unknown norm 'avnrom'"):
        args(retrofit_patch="avnrom")
    with pytest.raises(ValidationError, match="recovery.schedule.steps must be >= 1"):
        args(retrofit_recovery={"steps": 0})


def test_the_hooks_patch_calibrate_recover_and_save_a_full_finetune(plugin, base):
    cfg = Cfg(base_model=str(base / "base"), retrofit_patch="avnorm", retrofit_calibration_text=str(base / "book.txt"),
              retrofit_calibration_tokens=256, sequence_len=32, retrofit_recovery={"steps": 2},
              output_dir=str(base / "out"))
    plugin.pre_model_load(cfg)
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model)  # what axolotl's loader does
    plugin.post_model_build(cfg, model)
    assert retrofit.patch_record(model)["norm"] == "avnorm"
    assert retrofit.patch_record(model)["calibration"]["tokens"] == 256
    trainer = _train(model, [], base / "trainer")
    callbacks = plugin.add_callbacks_post_trainer(cfg, trainer)
    assert [type(c) for c in callbacks] == [RetrofitCallback] and callbacks[0].schedule.steps == 2
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.train()
    trainer.save_model(cfg.output_dir)  # axolotl's save_trained_model, then post_train
    plugin.post_train(cfg, trainer.model)
    expected = _logits(trainer.model)
    assert torch.equal(_logits(retrofit.from_pretrained(cfg.output_dir)), expected)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(cfg.output_dir)), expected)  # enabled


def test_a_lora_run_trains_the_patch_and_its_adapter_folder_reloads(plugin, base):
    from peft import LoraConfig, get_peft_model
    cfg = Cfg(base_model=str(base / "base"), retrofit_patch="ssmax", adapter="lora", lora_target_modules=["q_proj"],
              output_dir=str(base / "out"))
    plugin.pre_model_load(cfg)
    model = AutoModelForCausalLM.from_pretrained(cfg.base_model)
    plugin.post_model_build(cfg, model)
    assert cfg.lora_modules_to_save == ["retrofit"]  # SSMax's s trains with the adapter
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=cfg.lora_target_modules,
                                            modules_to_save=cfg.lora_modules_to_save, task_type="CAUSAL_LM"))
    trainer = _train(peft, [], base / "trainer")
    trainer.train()
    trainer.save_model(cfg.output_dir)  # PEFT's adapter files only
    plugin.post_train(cfg, trainer.model)
    assert torch.equal(_logits(retrofit.from_pretrained(cfg.output_dir)), _logits(trainer.model))


def test_a_base_patched_otherwise_or_calibration_without_gains_is_one_line(plugin, base):
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    with pytest.raises(RetrofitError, match="already patched with psoftmax; retrofit_patch asks for avnorm"):
        plugin.post_model_build(Cfg(retrofit_patch="avnorm"), model)
    plugin.post_model_build(Cfg(retrofit_patch="psoftmax:p=2"), model)  # the same patch: kept as loaded
    with pytest.raises(RetrofitError, match="retrofit_calibration_text sets per-head gains"):
        plugin.post_model_build(Cfg(retrofit_patch="softmax1", base_model=str(base / "base"),
                                    retrofit_calibration_text=str(base / "book.txt")), tiny_model("llama"))


def _lora(model):
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=["retrofit"],
                                            task_type="CAUSAL_LM"))


@pytest.mark.parametrize("name", ["retrofit.json", "retrofit.safetensors"])
def test_post_train_never_writes_through_a_link_in_output_dir(name, plugin, tmp_path):
    """Issue 61: with output_dir/retrofit.json a symbolic link to a file outside, post_train overwrote that file with
    retrofit's record. Now a link in either name is refused in one line before anything is written; the file it
    points at and the link stay as they were."""
    model = tiny_model("llama")
    retrofit.patch(model, "ssmax")
    out, outside = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text("the user's own file\n")
    (out / name).symlink_to(outside)
    with pytest.raises(RetrofitError, match=rf"^{out / name} is a symbolic link; retrofit never writes through a "
                                            r"link .*\)$") as caught:
        plugin.post_train(Cfg(retrofit_patch="ssmax", base_model="base", output_dir=str(out)), _lora(model))
    assert "\n" not in str(caught.value)
    assert outside.read_text() == "the user's own file\n" and (out / name).is_symlink()
    assert sorted(p.name for p in out.iterdir()) == [name]  # neither file written, no temporary left


def test_post_train_writes_both_files_atomically_beside_the_adapter(plugin, tmp_path):
    """The files post_train writes reload, and no temporary sibling is left (atomic_writer)."""
    model = tiny_model("llama")
    retrofit.patch(model, "ssmax")
    out = tmp_path / "out"
    out.mkdir()
    plugin.post_train(Cfg(retrofit_patch="ssmax", base_model="base", output_dir=str(out)), _lora(model))
    assert sorted(p.name for p in out.iterdir()) == ["retrofit.json", "retrofit.safetensors"]
    from safetensors.torch import load_file
    assert any(".retrofit." in key for key in load_file(out / "retrofit.safetensors"))
    assert json.loads((out / "retrofit.json").read_text())["patch"]["norm"] == "ssmax"


@pytest.mark.parametrize("value, expected", [("embed_tokens", ["embed_tokens", "retrofit"]),
                                             (["lm_head"], ["lm_head", "retrofit"]), (None, ["retrofit"])])
def test_lora_modules_to_save_as_one_name_is_that_module(value, expected, plugin):
    """Issue 61: `lora_modules_to_save: embed_tokens` (a string) became a list of its characters."""
    cfg = Cfg(retrofit_patch="ssmax", adapter="lora", lora_modules_to_save=value)
    plugin.post_model_build(cfg, tiny_model("llama"))
    assert cfg.lora_modules_to_save == expected


@pytest.mark.parametrize("value", [3, ["embed_tokens", 3], {"embed_tokens": True}])
def test_lora_modules_to_save_of_another_type_is_one_line(value, plugin):
    with pytest.raises(RetrofitError, match=r"^lora_modules_to_save must be a module name or a list of them "
                                            r"\(e\.g\. \[embed_tokens, lm_head\]\), got "):
        plugin.post_model_build(Cfg(retrofit_patch="ssmax", adapter="lora", lora_modules_to_save=value),
                                tiny_model("llama"))


@pytest.mark.parametrize("value, message", [
    ({"steps": "2"}, r"retrofit_recovery.steps must be an integer, got '2'"),
    ({"stepz": 2}, r"unknown recipe key retrofit_recovery.stepz \(did you mean 'steps'\?\); valid keys in "
                   r"retrofit_recovery: steps, start"),
    ({"steps": 2, "start": "high"}, r"retrofit_recovery.start must be a number, got 'high'"),
    ({"steps": 2, "shape": "cosin"}, r"retrofit_recovery.shape must be one of linear, cosine, loss, got 'cosin' "
                                     r"\(did you mean 'cosine'\?\)"),
    ({"steps": 2, "costs": [1, "x"]}, r"retrofit_recovery.costs\[1\] must be a number, got 'x'"),
])
def test_a_bad_recovery_schedule_is_a_validation_error_not_a_traceback(value, message, plugin):
    """Issue 61: schedule values reached Python's operators (`"2" >= 1`) or ScheduleSection(**value) (an unknown
    keyword): a TypeError, which pydantic lets escape (it reports only ValueError), so axolotl would print a
    traceback. Now RetrofitArgs reports it as this key's validation error, one line of retrofit's."""
    from retrofit.integrations.axolotl import RetrofitArgs
    with pytest.raises(ValidationError, match=message) as caught:
        RetrofitArgs(retrofit_recovery=value)
    assert caught.value.errors()[0]["loc"] == ("retrofit_recovery",)
    with pytest.raises(RetrofitError, match=message):
        plugin.add_callbacks_post_trainer(Cfg(retrofit_recovery=value), None)
