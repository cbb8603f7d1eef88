"""What loading must never do (issue 26): run a model folder's code, load a damaged checkpoint with random weights,
or change the saved dtype. (Threads and replicas on a patched model: tests/patch/test_threads.py.)

The remote-code tests plant a folder whose `auto_map` points at a module that writes a canary file when imported,
answer `y` on stdin, and check that nothing ran. Tiny models throughout; a few real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrofit.errors import RetrofitError
from tests.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]
REFUSAL = ("has an auto_map (custom code); retrofit never runs a model folder's code — use a model whose architecture "
           "transformers ships")


# ---- remote code (item 3) ---------------------------------------------------------------------------------------

def plant(folder: Path, canary: Path, where: str) -> Path:
    """A tiny llama folder whose `where` (config.json | tokenizer_config.json) has an auto_map to a module that writes
    `canary` when imported. With config.json, model_type is one transformers does not know: only the code loads it."""
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    path = folder / where
    data = json.loads(path.read_text())
    if where == "config.json":
        data["model_type"] = "plantedllama"
        data["auto_map"] = {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"}
    else:
        data["auto_map"] = {"AutoTokenizer": ["planted.PlantedTokenizer", "planted.PlantedTokenizer"]}
    path.write_text(json.dumps(data))
    (folder / "planted.py").write_text(
        f"open({str(canary)!r}, 'w').write('the folder ran its code')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class PlantedConfig(LlamaConfig):\n    model_type = 'plantedllama'\n"
        "class PlantedModel(LlamaForCausalLM):\n    config_class = PlantedConfig\n"
        "class PlantedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return folder


def tokenizer_only(folder: Path, source: Path) -> Path:
    """The tokenizer files of `source` alone (what `--tokenizer FOLDER` takes)."""
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "planted.py"):
        (folder / name).write_bytes((source / name).read_bytes())
    return folder


def env_for(tmp_path: Path) -> dict:
    """A subprocess whose Hugging Face caches (where transformers copies a folder's modules) live under tmp_path."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"),
            "HF_MODULES_CACHE": str(tmp_path / "hf" / "modules"), "HF_HUB_OFFLINE": "1"}


def test_the_planted_module_is_live_when_code_is_trusted(tmp_path):
    """The plant works: transformers with trust_remote_code=True imports it (so the canary tests below can fail)."""
    canary = tmp_path / "canary"
    model = plant(tmp_path / "model", canary, "config.json")
    code = f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(model)!r}, trust_remote_code=True)"
    subprocess.run([sys.executable, "-c", code], env=env_for(tmp_path), check=True, capture_output=True, timeout=300)
    assert canary.read_text() == "the folder ran its code"


def test_patch_eval_and_a_tokenizer_answered_yes_run_nothing(tmp_path):
    """`retrofit patch`, `retrofit eval`, and `eval --tokenizer`, each with `y` on stdin: exit 2, one line naming
    auto_map and the file, and the planted module never imported."""
    canary = tmp_path / "canary"
    model = plant(tmp_path / "model", canary, "config.json")
    tok_model = plant(tmp_path / "tokmodel", canary, "tokenizer_config.json")
    tokenizer = tokenizer_only(tmp_path / "tok", tok_model)
    clean = tmp_path / "clean"
    tiny_model("llama").save_pretrained(clean)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat and the dog ran far. " * 20)
    cases = {
        "patch": ([*"patch --norm avnorm".split(), str(model), "--out", str(tmp_path / "o1")], model, "config.json"),
        "eval": (["eval", str(model), "--data", str(text), "--lengths", "8", "--out", str(tmp_path / "o2")], model,
                 "config.json"),
        "patch-tokenizer-config": ([*"patch --norm avnorm".split(), str(tok_model), "--out", str(tmp_path / "o3")],
                                   tok_model, "tokenizer_config.json"),
        "eval-tokenizer": (["eval", str(clean), "--tokenizer", str(tokenizer), "--data", str(text), "--lengths", "8",
                            "--out", str(tmp_path / "o4")], tokenizer, "tokenizer_config.json"),
    }
    runs = {name: subprocess.Popen([sys.executable, "-m", "retrofit", *argv], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(tmp_path))
            for name, (argv, _, _) in cases.items()}
    for name, proc in runs.items():
        _, err = proc.communicate(input="y\n", timeout=300)
        lines = [line for line in err.splitlines() if line.strip()]
        _, folder, file = cases[name]
        assert proc.returncode == 2 and "Traceback" not in err and len(lines) == 1, (name, err)
        assert lines[0].endswith(f"{folder}: {file} {REFUSAL}"), (name, lines[0])
        assert "[y/N]" not in err
    assert not canary.exists()
    assert not any(tmp_path.glob("o*"))


def test_every_loader_refuses_before_transformers_and_passes_trust_remote_code_false(tmp_path, monkeypatch):
    """In process: load_config/load/from_pretrained/load_tokenizer refuse the folder; with the refusal taken
    out, transformers itself (told trust_remote_code=False) still refuses in one line, and nothing runs."""
    import retrofit
    from retrofit.load import load as load_any
    from retrofit.load import load_config, load_tokenizer, models, sources

    canary = tmp_path / "canary"
    model = plant(tmp_path / "model", canary, "config.json")
    tok = tokenizer_only(tmp_path / "tok", plant(tmp_path / "tokmodel", canary, "tokenizer_config.json"))
    for load, source in ((load_config, model), (load_any, model), (retrofit.from_pretrained, model),
                         (load_tokenizer, model), (load_tokenizer, tok)):
        with pytest.raises(RetrofitError, match="auto_map") as err:
            load(str(source))
        assert "\n" not in str(err.value)
    monkeypatch.setattr(sources, "refuse_custom_code", lambda *a, **k: None)
    monkeypatch.setattr(models, "refuse_custom_code", lambda *a, **k: None)
    for load in (load_config, load_any):
        with pytest.raises(RetrofitError, match="ships custom code") as err:
            load(str(model))
        assert "\n" not in str(err.value)
    assert load_tokenizer(str(tok)) is not None  # a known tokenizer class: transformers uses its own, not the folder's
    assert not canary.exists()


def test_the_harness_refuses_trust_remote_code_and_a_planted_folder(tmp_path):
    pytest.importorskip("lm_eval")
    from retrofit.evaluate.harness import RetrofitLM

    canary = tmp_path / "canary"
    model = plant(tmp_path / "model", canary, "config.json")
    with pytest.raises(RetrofitError, match=r"config.json has an auto_map"):
        RetrofitLM(str(model), device="cpu")
    with pytest.raises(RetrofitError, match="never runs a model's own code"):
        RetrofitLM(str(model), device="cpu", trust_remote_code=True)
    assert not canary.exists()


# ---- damaged checkpoints (item 4) --------------------------------------------------------------------------------

def saved_patched(folder: Path, model_type: str, norm: str = "avnorm", nope: bool = False):
    """A tiny patched model with random patch parameters, saved to folder; returns the model."""
    import torch

    import retrofit

    model = tiny_model(model_type)
    retrofit.patch(model, norm, nope=nope)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.copy_(torch.rand(p.shape) + 0.5)
    model.save_pretrained(folder)
    return model


def edit_weights(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type, key", [
    ("llama", "model.layers.0.self_attn.o_proj.weight"),   # a base weight
    ("llama", "model.norm.weight"),                          # a base norm parameter
    ("llama", "model.layers.1.self_attn.retrofit.gain"),    # the patch's norm parameter
    ("gpt2", "transformer.wpe.weight"),                      # the position table (the model keeps its positions)
    ("gpt2", "transformer.h.0.attn.c_proj.bias"),
])
def test_a_missing_key_is_one_line_naming_it(tmp_path, model_type, key):
    import retrofit

    saved_patched(tmp_path / "ckpt", model_type)
    edit_weights(tmp_path / "ckpt", lambda t: t.pop(key))
    with pytest.raises(RetrofitError) as err:
        retrofit.from_pretrained(str(tmp_path / "ckpt"))
    assert "\n" not in str(err.value) and key in str(err.value), str(err.value)


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.extra.weight", "model.layers.0.self_attn.retrofit.bogus",
                                 "model.layers.0.self_attn.retrofit.weight"])
def test_an_unexpected_key_is_one_line_naming_it(tmp_path, key):
    import torch

    import retrofit

    saved_patched(tmp_path / "ckpt", "llama")
    edit_weights(tmp_path / "ckpt", lambda t: t.update({key: torch.ones(32)}))
    with pytest.raises(RetrofitError, match="unexpected") as err:
        retrofit.from_pretrained(str(tmp_path / "ckpt"))
    assert "\n" not in str(err.value) and key in str(err.value), str(err.value)


def test_a_patch_tensor_of_the_wrong_shape_is_refused(tmp_path):
    import torch

    import retrofit

    saved_patched(tmp_path / "ckpt", "llama")
    edit_weights(tmp_path / "ckpt", lambda t: t.update({"model.layers.0.self_attn.retrofit.gain": torch.ones(3)}))
    with pytest.raises(RetrofitError, match="wrong shape model.layers.0.self_attn.retrofit.gain"):
        retrofit.from_pretrained(str(tmp_path / "ckpt"))


@pytest.mark.parametrize("norm", ["avnorm", "ssmax"])
def test_a_nope_model_without_its_position_table_loads_and_equals_what_was_saved(tmp_path, norm):
    """What the patch itself removes (GPT-2's wpe under NoPE) is the one missing key accepted."""
    import torch
    from safetensors import safe_open

    import retrofit
    from tests.tiny import random_ids

    model = saved_patched(tmp_path / "ckpt", "gpt2", norm=norm, nope=True)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert "transformer.wpe.weight" not in f.keys()  # the legitimate case really lacks the table
    loaded = retrofit.from_pretrained(str(tmp_path / "ckpt"))
    ids = random_ids(2, 12)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    mine, theirs = loaded.state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_an_adapter_with_foreign_patch_tensors_is_refused(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    from retrofit.load import load_adapter, save_adapter

    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "base")
    import retrofit
    retrofit.patch(base, "avnorm")
    lora = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    save_adapter(lora, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    tensors = load_file(str(tmp_path / "adapter" / "retrofit.safetensors"))
    tensors["model.layers.7.self_attn.retrofit.gain"] = torch.ones(4)
    save_file(tensors, str(tmp_path / "adapter" / "retrofit.safetensors"))
    with pytest.raises(RetrofitError, match=r"model.layers.7.self_attn.retrofit.gain\): it belongs to another"):
        load_adapter(tmp_path / "adapter")


# ---- dtype (item 11) -----------------------------------------------------------------------------------------------

def bf16_folder(folder: Path) -> Path:
    import torch

    tiny_model("llama").to(torch.bfloat16).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def saved_dtypes(folder: Path) -> set:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}


def test_patch_keeps_a_bf16_model_bf16_and_from_pretrained_reloads_it_as_saved(tmp_path, capsys):
    import torch

    import retrofit
    from retrofit.cli import main
    from tests.tiny import random_ids

    source = bf16_folder(tmp_path / "bf16")
    assert main(["patch", str(source), "--norm", "avnorm", "--out", str(tmp_path / "patched")]) == 0
    assert saved_dtypes(tmp_path / "patched") == {torch.bfloat16}  # base and patch tensors: no fp32 copy
    model = retrofit.from_pretrained(str(tmp_path / "patched"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert retrofit.from_pretrained(str(tmp_path / "patched"), dtype="auto").dtype == torch.bfloat16
    for asked in ("float32", torch.float32):
        fp32 = retrofit.from_pretrained(str(tmp_path / "patched"), dtype=asked)
        assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    ids = random_ids(2, 12)
    with torch.no_grad():  # the same weights: fp32 of the bf16 values exactly
        torch.testing.assert_close(fp32(input_ids=ids).logits, model.float()(input_ids=ids).logits, rtol=0, atol=0)
    assert main(["patch", str(source), "--norm", "avnorm", "--dtype", "float32", "--out", str(tmp_path / "p32")]) == 0
    assert saved_dtypes(tmp_path / "p32") == {torch.float32}


def test_plain_loads_keep_the_saved_dtype_and_eval_reports_it(tmp_path, capsys):
    import torch

    from retrofit.cli import main
    from retrofit.load import load

    source = bf16_folder(tmp_path / "bf16")
    assert load(str(source)).dtype == torch.bfloat16
    assert load(str(source), dtype="float32").dtype == torch.float32
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat and the dog ran far. " * 20)
    for dtype, expected in (("auto", "bfloat16"), ("float32", "float32")):
        out = tmp_path / f"eval-{dtype}"
        assert main(["eval", str(source), "--data", str(text), "--lengths", "8", "--dtype", dtype, "--out", str(out),
                     "--no-progress"]) == 0
        assert json.loads((out / "results.json").read_text())["models"][0]["dtype"] == expected


def test_a_recipe_takes_auto_by_default_and_trains_fp32_master_weights(tmp_path):
    """model.dtype auto (the default) loads a bf16 source and trains it in float32 (the run saves float32);
    bfloat16 keeps the weights bf16; an unknown dtype is refused in one line."""
    import torch

    from retrofit.load import load_base
    from retrofit.recipe import recipe_from_dict
    from retrofit.train import train

    source = bf16_folder(tmp_path / "bf16")
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat and the dog ran far. " * 60)

    def recipe(**model):
        return recipe_from_dict({
            "model": {"source": str(source), **model}, "patch": {"norm": "avnorm"},
            "data": {"task": "lm", "files": [str(text)], "seq_len": 16, "val_blocks": 1},
            "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1,
                      "progress": False},
            "eval": {"batches": 1, "batch_size": 2}, "output": {"dir": str(tmp_path / "run"), "save_every": 0}})

    assert recipe().model.dtype == "auto"
    assert load_base(recipe())[0].dtype == torch.float32
    assert load_base(recipe(dtype="bfloat16"))[0].dtype == torch.bfloat16
    with pytest.raises(RetrofitError, match="model.dtype"):
        recipe(dtype="float8")
    result = train(recipe())
    assert result.steps == 2 and result.losses and all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert {p.dtype for p in result.model.parameters()} == {torch.float32}
    assert saved_dtypes(tmp_path / "run") == {torch.float32}
