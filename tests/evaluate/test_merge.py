"""`retrofit eval --merge`: finished evaluations as one report, nothing re-scored. A length run on its own and merged
gives exactly the rows and paired differences of one run over every length; bad merges are one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

import retrofit
from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.evaluate import EvalSpec, evaluate_models
from retrofit.evaluate.merge import merge_results
from retrofit.evaluate.report import write_report
from tests.tiny import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _docs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (90, 70)]


def _models():
    torch.manual_seed(0)
    return tiny_model("llama"), tiny_model("llama")  # different random weights


def _run(models, names, lengths, tmp_path, folder, docs=None, reference=None):
    results = evaluate_models(list(models), EvalSpec(tokens=docs or _docs(), lengths=lengths, names=names,
                                                     max_windows=3, reference=reference, progress=False))
    write_report(results, tmp_path / folder)
    return tmp_path / folder / "results.json"


def _without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s", "peak_memory_mb", "start_memory_mb")}
            for r in rows]


def test_lengths_run_apart_and_merged_equal_one_run(tmp_path):
    a, b = _models()
    whole = json.loads(_run([a, b], ["a", "b"], [8, 16], tmp_path, "whole", reference="b").read_text())
    parts = [_run([a, b], ["a", "b"], [n], tmp_path, f"at{n}") for n in (16, 8)]
    merged = merge_results(parts, reference="b")
    assert merged["lengths"] == [8, 16] and [m["name"] for m in merged["models"]] == ["a", "b"]
    for mine, theirs in zip(merged["models"], whole["models"]):
        assert _without_timing(mine["lengths"]) == _without_timing(theirs["lengths"])
    assert merged["comparisons"] == whole["comparisons"]
    assert merged["settings"]["merged_from"] == [str(p) for p in parts]


def test_a_model_added_later_is_paired_with_the_earlier_ones(tmp_path):
    a, b = _models()
    first = _run([a], ["a"], [8, 16], tmp_path, "first")
    later = _run([b], ["b"], [16], tmp_path, "later")
    rows = merge_results([first, later], reference="a")["comparisons"]["rows"]
    assert [(r["model"], r["length"], r["paired"]) for r in rows] == [("b", 16, True)]
    together = json.loads(_run([a, b], ["a", "b"], [16], tmp_path, "together").read_text())
    assert rows[0]["difference"] == together["comparisons"]["rows"][0]["difference"]
    assert rows[0]["ci95"] == together["comparisons"]["rows"][0]["ci95"]


def test_a_model_is_one_model_whether_or_not_a_flag_restated_its_patch(tmp_path):
    """The same checkpoint evaluated with a --rope it already carries and without: one model, both rows."""
    model = tiny_model("llama")
    retrofit.patch(model, "softmax", rope="dynamic:4")
    model.save_pretrained(tmp_path / "ckpt")
    source = str(tmp_path / "ckpt")
    parts = []
    for folder, length, rope in (("flag", 8, "dynamic:4"), ("plain", 16, None)):
        results = evaluate_models([source], EvalSpec(tokens=_docs(), lengths=[length], names=["m"], rope=rope,
                                                     max_windows=3, progress=False))
        write_report(results, tmp_path / folder)
        parts.append(tmp_path / folder / "results.json")
    merged = merge_results(parts)
    assert [m["name"] for m in merged["models"]] == ["m"]
    assert [r["length"] for r in merged["models"][0]["lengths"]] == [8, 16]


def test_cli_merge_writes_the_report_and_prints_the_tables(tmp_path, capsys):
    a, b = _models()
    parts = [_run([a, b], ["a", "b"], [n], tmp_path, f"at{n}") for n in (8, 16)]
    out = tmp_path / "merged"
    assert main(["eval", "--merge", *map(str, parts), "--reference", "b", "--out", str(out)]) == 0
    written = json.loads((out / "results.json").read_text())
    assert written["comparisons"]["references"] == ["b"] and written["lengths"] == [8, 16]
    assert "Paired differences to b" in capsys.readouterr().out
    assert (out / "results.md").is_file() and (out / "loss_vs_length.png").is_file()


def test_bad_merges_are_one_line_and_write_nothing(tmp_path, capsys):
    a, b = _models()
    at8 = _run([a, b], ["a", "b"], [8], tmp_path, "at8")
    again = _run([a], ["a"], [8], tmp_path, "again")
    other_data = _run([a], ["c"], [8], tmp_path, "other", docs=_docs(1)[:1])
    patched = tiny_model("llama")
    retrofit.patch(patched, "softmax")
    renamed = _run([patched], ["a"], [16], tmp_path, "patched")
    (tmp_path / "junk.json").write_text("{not json")
    cases = [
        (["--merge", str(at8)], "at least two"),
        (["--merge", str(at8), str(again)], "a has lengths rows at length 8 in two files"),
        (["--merge", str(at8), str(other_data)], "different data"),
        (["--merge", str(at8), str(renamed)], "two different models are named 'a'"),
        (["--merge", str(at8), str(tmp_path / "junk.json")], "cannot read it as JSON"),
        (["--merge", str(at8), str(again), "--reference", "zz"], "a has lengths rows"),
        (["runs/x", "--merge", str(at8), str(again)], "--merge takes results.json files, not models"),
    ]
    for argv, message in cases:
        out = tmp_path / "out"
        assert main(["eval", *argv, "--out", str(out)]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
        assert not out.exists()
    with pytest.raises(RetrofitError, match="--reference zz is not one of the models"):
        merge_results([at8, _run([b], ["d"], [8], tmp_path, "d")], reference="zz")
