"""`retrofit eval --variants FILE`: training-free settings side by side in one report — each variant equals
the same setting evaluated on its own, a calibrated AVNorm variant is calibrated on its own text, bad
variant files are one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml

from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.evaluate import EvalSpec, check_variants, evaluate_models
from tests.evaluate.test_evaluate import _char_tokenizer
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "it is a truth universally acknowledged that a single man in possession of a good fortune. " * 30


@pytest.fixture
def folder(tmp_path):
    tok = _char_tokenizer(TEXT)
    path = tmp_path / "tiny-llama"
    tiny_model("llama", max_position_embeddings=16, vocab_size=len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    (tmp_path / "book.txt").write_text(TEXT)
    (tmp_path / "other.txt").write_text(TEXT[::-1])
    return path


def test_variants_evaluate_each_setting_as_it_would_be_alone(folder, tmp_path, capsys):
    variants = [{"name": "original"}, {"name": "yarn2", "rope": "yarn:2"},
                {"name": "yarn2+avnorm", "rope": "yarn:2", "patch": {"norm": "avnorm"},
                 "calibrate": {"data": str(tmp_path / "other.txt"), "tokens": 600}}]
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(variants))
    out = tmp_path / "eval"
    assert main(["eval", str(folder), "--variants", str(tmp_path / "v.yaml"), "--data", str(tmp_path / "book.txt"),
                 "--lengths", "16,32", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    models = json.loads((out / "results.json").read_text())["models"]
    assert [m["name"] for m in models] == ["original", "yarn2", "yarn2+avnorm"]
    alone = {"original": evaluate_models([str(folder)], EvalSpec(data=str(tmp_path / "book.txt"), lengths=[16, 32],
                                                                 progress=False)),
             "yarn2": evaluate_models([str(folder)], EvalSpec(data=str(tmp_path / "book.txt"), lengths=[16, 32],
                                                              rope="yarn:2", progress=False))}
    for m in models[:2]:
        assert [r["loss"] for r in m["lengths"]] == [r["loss"] for r in alone[m["name"]]["models"][0]["lengths"]]
    assert models[0]["rope"] == "none" and models[1]["rope"].startswith("yarn x2")
    calibration = models[2]["retrofit"]["calibration"]
    assert calibration is not None and calibration["tokens"] == 600 and calibration["gain_mean"] != 1.0
    assert models[2]["lengths"][0]["loss"] != models[1]["lengths"][0]["loss"]


@pytest.mark.parametrize("variants, message", [
    ([], "non-empty list"),
    ([{"rope": "yarn:2"}], "needs a name"),
    ([{"name": "a"}, {"name": "a", "rope": "yarn:2"}], "two variants are named 'a'"),
    ([{"name": "a", "ropes": "yarn:2"}], "unknown keys \\['ropes'\\]"),
    ([{"name": "a", "patch": "avnorm"}], "patch must be a mapping"),
    ([{"name": "a", "patch": {"norm": "avnorm"}, "calibrate": {"data": "/no/such.txt"}}], "existing file"),
])
def test_bad_variants_are_one_line_errors(variants, message):
    with pytest.raises(RetrofitError, match=message):
        check_variants(variants)


def test_variants_with_a_global_rope_is_refused_at_the_cli(folder, tmp_path, capsys):
    (tmp_path / "v.yaml").write_text(yaml.safe_dump([{"name": "a"}]))
    code = main(["eval", str(folder), "--variants", str(tmp_path / "v.yaml"), "--rope", "yarn:2", "--data",
                 str(tmp_path / "book.txt"), "--lengths", "16", "--out", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert code == 2 and "either variants or one patch/rope" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "eval").exists()
