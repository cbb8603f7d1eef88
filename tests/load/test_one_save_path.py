"""One way retrofit saves a model (retrofit.load.save.save_model, atomic): `retrofit patch --out`, `--push-to-hub`
without --out, a training run's final save and the Python API all write through it. There were three (the patch
command's own save_atomically, train's _atomic_files around load.save_model, load.save_model itself); a fourth that
came back would skip the atomic rename or the refusals, and these tests fail on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.load import save as model_saving
from retrofit.load import save_model
from retrofit.recipe import recipe_from_dict
from retrofit.train import train
from tests.tiny import TINY, char_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2] / "retrofit"

# Every module of retrofit/ that calls save_pretrained, and why it is not a second way to save a model.
SAVE_PRETRAINED_CALLERS = {
    "load/save.py": "the one way: save_model writes the model (and tokenizer) into its temporary folder",
    "load/adapters.py": "save_adapter: a PEFT adapter, not a model; save_loadable_base: inside save_model's folder",
    "hub/publish.py": "a merged LoRA model staged for upload in push's scratch folder, never a user's folder",
}


def _callers() -> set[str]:
    found = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "save_pretrained":
                found.add(str(path.relative_to(ROOT)))
    return found


def test_only_the_known_modules_call_save_pretrained():
    assert _callers() == set(SAVE_PRETRAINED_CALLERS)


@pytest.fixture
def written(monkeypatch) -> list[Path]:
    """The folders save_model's writer wrote into (each a temporary one, renamed into place after)."""
    calls, real = [], model_saving._write_model

    def spy(model, folder, *args, **kwargs):
        calls.append(kwargs["final_dir"])
        return real(model, folder, *args, **kwargs)

    monkeypatch.setattr(model_saving, "_write_model", spy)
    return calls


def test_retrofit_patch_saves_through_save_model(written, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    char_tokenizer().save_pretrained(tmp_path / "m")
    assert main(["patch", str(tmp_path / "m"), "--norm", "softmax", "--out", str(tmp_path / "out")]) == 0
    assert written == [tmp_path / "out"] and (tmp_path / "out" / "config.json").is_file()


def test_a_training_runs_final_save_goes_through_save_model(written, tmp_path):
    run = tmp_path / "run"
    recipe = {"model": {"config": {"model_type": "gpt2", **TINY["gpt2"], "vocab_size": 16}},
              "data": {"task": "counting", "seq_len": 32},
              "train": {"steps": 1, "batch_size": 2, "micro_batch_size": 2, "progress": False},
              "eval": {"batches": 1, "batch_size": 2}, "output": {"dir": str(run), "save_every": 0}}
    train(recipe_from_dict(recipe))
    assert written == [run] and (run / "model.safetensors").is_file() and (run / "result.json").is_file()
    assert not (run / model_saving.STAGING).exists()


def test_the_python_api_saves_atomically_and_keeps_the_refusals(written, tmp_path):
    model = tiny_model("llama")
    assert save_model(model, tmp_path / "a", tokenizer=char_tokenizer()) is model
    assert written == [tmp_path / "a"] and (tmp_path / "a" / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary sibling left
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(RetrofitError, match="exists and is not empty"):
        save_model(model, mine, what="--out")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and len(written) == 1  # refused before any write
