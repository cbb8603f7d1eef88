"""Reliability of loading (issue 26): a model folder's code never runs, a damaged checkpoint never loads with random
weights, AVNorm is right under threads and in DataParallel-style replicas, and a model keeps its saved dtype.

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
from tests.test_data import char_tokenizer
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
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
    """In process: load_config/load_model/from_pretrained/load_tokenizer refuse the folder; with the refusal taken
    out, transformers itself (told trust_remote_code=False) still refuses in one line, and nothing runs."""
    import retrofit
    from retrofit.load import load_config, load_model, load_tokenizer, models, sources

    canary = tmp_path / "canary"
    model = plant(tmp_path / "model", canary, "config.json")
    tok = tokenizer_only(tmp_path / "tok", plant(tmp_path / "tokmodel", canary, "tokenizer_config.json"))
    for load, source in ((load_config, model), (load_model, model), (retrofit.from_pretrained, model),
                         (load_tokenizer, model), (load_tokenizer, tok)):
        with pytest.raises(RetrofitError, match="auto_map") as err:
            load(str(source))
        assert "\n" not in str(err.value)
    monkeypatch.setattr(sources, "refuse_custom_code", lambda *a, **k: None)
    monkeypatch.setattr(models, "refuse_custom_code", lambda *a, **k: None)
    for load in (load_config, load_model):
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
