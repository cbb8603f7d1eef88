"""No silent wrong load (issue 36): every folder a patched model is saved to makes plain transformers refuse by
name (config.json's attn_implementation is retrofit.record.GUARD), while retrofit's loaders load it exactly.

The save/load matrix: save path (save_pretrained, transformers' Trainer.save_model, a PEFT merge, retrofit's
save_model and `retrofit patch --out`, `retrofit push --dry-run`) x load path (AutoModelForCausalLM, pipeline,
retrofit.from_pretrained, retrofit.load.load) -> refused / equal.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, pipeline

import retrofit
from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.load import load, save_model
from tests.tiny import char_tokenizer, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# retrofit.record.GUARD, spelled out: what users see in config.json and in transformers' refusal
GUARD = "retrofit checkpoint: load it with retrofit.from_pretrained(path), or call retrofit.enable() first"

IDS = random_ids(2, 12)


def _patched(norm="ssmax", **options):
    """A tiny patched Llama whose patch parameters are not the norm's defaults (a dropped patch shows)."""
    model = tiny_model("llama")
    retrofit.patch(model, norm, **options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    return model


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def save_plain(model, folder: Path) -> None:
    model.save_pretrained(folder)


def save_trainer(model, folder: Path) -> None:
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(output_dir=str(folder.parent / "trainer-out"), report_to=[], use_cpu=True)
    Trainer(model=model, args=args).save_model(str(folder))


def save_peft_merge(model, folder: Path) -> None:
    from peft import LoraConfig, get_peft_model
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():  # a LoRA that moved: the merge changes the weights
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(folder)
    return merged


def save_retrofit(model, folder: Path) -> None:
    save_model(model, folder, tokenizer=char_tokenizer())


def save_push(model, folder: Path) -> None:
    model.save_pretrained(folder.parent / "ckpt")
    assert main(["push", str(folder.parent / "ckpt"), "--repo", "me/x", "--dry-run", str(folder)]) == 0


SAVES = {"save_pretrained": save_plain, "Trainer.save_model": save_trainer, "peft merge": save_peft_merge,
         "retrofit save_model": save_retrofit, "retrofit push": save_push}


@pytest.mark.parametrize("how", list(SAVES))
def test_every_save_path_refuses_plain_transformers_and_reloads_exactly(how, tmp_path):
    model = _patched()
    folder = tmp_path / "saved"
    merged = SAVES[how](model, folder)
    expected = _logits(merged if merged is not None else model)
    assert json.loads((folder / "config.json").read_text())["attn_implementation"] == GUARD
    with pytest.raises(ValueError, match=r"retrofit\.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(str(folder))
    with pytest.raises(Exception, match=r"retrofit\.from_pretrained"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline("text-generation", model=str(folder), tokenizer=char_tokenizer())
    for loader in (retrofit.from_pretrained, load):
        reloaded = loader(str(folder))
        assert torch.equal(_logits(reloaded), expected), (how, loader)
        assert reloaded.config.attn_implementation == GUARD  # re-saving it keeps the guard


def test_the_cli_patch_out_folder_is_guarded(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "base")
    char_tokenizer().save_pretrained(tmp_path / "base")
    out = tmp_path / "out"
    assert main(["patch", str(tmp_path / "base"), "--norm", "psoftmax", "--p", "2", "--out", str(out)]) == 0
    with pytest.raises(ValueError, match=r"retrofit\.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert retrofit.is_patched(retrofit.from_pretrained(str(tmp_path / "out")))


def test_unpatch_removes_the_guard_and_the_saved_model_is_plain_again(tmp_path):
    model = _patched("psoftmax", p=2.0)
    assert model.config.attn_implementation == GUARD
    retrofit.unpatch(model)
    assert "attn_implementation" not in model.config.__dict__
    model.save_pretrained(tmp_path / "plain")
    assert "attn_implementation" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain"))), _logits(model))


def test_a_pushed_training_run_reloads(tmp_path):
    """`retrofit push RUN --dry-run DIR` of a finished run: DIR loads with retrofit.from_pretrained (it used to be
    refused as an unfinished run: recipe.yaml went up, result.json did not)."""
    model = _patched("avnorm")
    run = tmp_path / "runs" / "ft"
    save_model(model, run, tokenizer=char_tokenizer())
    (run / "recipe.yaml").write_text(f"name: ft\nmodel: {{source: {tmp_path / 'base'}}}\npatch: {{norm: avnorm}}\n")
    (run / "log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (run / "result.json").write_text(json.dumps({"steps": 1, "final_loss": 3.0, "model_type": "llama",
                                                 "source": str(tmp_path / "base")}))
    assert main(["push", str(run), "--repo", "me/x", "--dry-run", str(tmp_path / "dry")]) == 0
    staged = json.loads((tmp_path / "dry" / "result.json").read_text())
    assert staged["steps"] == 1 and staged["source"] == "base"  # published as a name, not this machine's path
    assert torch.equal(_logits(retrofit.from_pretrained(str(tmp_path / "dry"))), _logits(model))
    (tmp_path / "dry" / "result.json").unlink()  # as an older retrofit pushed it: still a published, whole model
    assert torch.equal(_logits(retrofit.from_pretrained(str(tmp_path / "dry"))), _logits(model))
    (run / "result.json").unlink()  # the run itself without result.json: unfinished (it has log.jsonl)
    with pytest.raises(RetrofitError, match="unfinished training run"):
        retrofit.from_pretrained(str(run))
    shutil.rmtree(tmp_path / "dry")


@pytest.mark.parametrize("norm,options", [("psoftmax", {"p": 2.0}), ("avnorm", {"gain": 3.0})])
def test_unpatch_of_a_compiled_model_unwraps_it(norm, options):
    # Dynamo does not guard on module hooks (torch._dynamo.config.skip_nnmodule_hook_guards): a graph compiled
    # for another instance of the class without AVNorm's hooks would be reused here. Start from a clean cache.
    torch._dynamo.reset()
    model = tiny_model("llama")
    original = _logits(model)
    retrofit.patch(model, norm, **options)
    compiled = torch.compile(model, backend="eager")
    patched = _logits(compiled)
    assert not torch.allclose(patched, original)
    retrofit.unpatch(compiled)
    assert not retrofit.is_patched(model) and model.config._attn_implementation == "sdpa"
    assert not {"set_attn_implementation", "push_to_hub"} & model.__dict__.keys()  # nothing left on the model
    assert not hasattr(model.config, "retrofit") and "attn_implementation" not in model.config.__dict__
    assert torch.allclose(_logits(compiled), original, atol=1e-6)  # the wrapper recompiled: the original model
    assert torch.equal(_logits(model), original)
