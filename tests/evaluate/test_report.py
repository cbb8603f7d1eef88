"""retrofit.evaluate.report: the schema, tables and plots from hand-written result dicts (no model needed)."""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path

import pytest

from retrofit.errors import RetrofitError
from retrofit.evaluate import position_buckets
from retrofit.evaluate.report import RESULTS_SCHEMA, loss_table_markdown, tidy_rows, validate, write_report

LENGTHS = [16, 32, 64, 128]


def _length_row(length, loss, beyond=False):
    buckets = [{"start": a, "end": b, "loss": loss + 0.01 * i, "tokens": 2 * (b - a)}
               for i, (a, b) in enumerate(position_buckets(length))]
    return {"length": length, "loss": loss, "windows": 2, "tokens": 2 * length, "time_s": 0.5, "tokens_per_s": 64.0,
            "peak_memory_mb": 300.0, "start_memory_mb": 290.0, "beyond_max_positions": beyond,
            "windows_sha1": "0" * 40, "by_position": buckets}


def fake_results():
    models = []
    for i, name in enumerate(["base", "avnorm"]):
        models.append({
            "name": name, "source": f"runs/{name}", "model_type": "llama", "tokenizer": "abc", "dtype": "float32",
            "retrofit": None if i == 0 else {"norm": "avnorm", "options": {}, "nope": False},
            "max_learned_positions": None, "max_position_embeddings": 64, "memory_kind": "rss",
            "lengths": [_length_row(n, 3.0 + i + n / 100, beyond=n > 64) for n in LENGTHS],
            "passkey": [{"length": n, "depth": d, "accuracy": 0.5, "trials": 4}
                        for n in LENGTHS for d in (0.0, 0.5, 1.0)],
            "counting": [{"length": n, "l1": 0.1 * n, "mse": 0.01 * n * n, "sequences": 4} for n in LENGTHS],
        })
    return {"schema": "retrofit.eval/1", "train_len": 32, "lengths": LENGTHS,
            "data": {"files": ["book.txt"], "documents": [5000]}, "settings": {"max_tokens": 256}, "models": models}


def test_report_files_contain_every_model_and_length(tmp_path):
    results = fake_results()
    paths = write_report(results, tmp_path / "eval")
    names = {p.name for p in paths}
    assert names == {"results.json", "results.csv", "results.md", "loss_vs_length.png", "loss_by_position.png",
                     "passkey.png", "counting.png"}
    for p in paths:
        assert p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "eval" / "results.json").read_text()) == results
    markdown = (tmp_path / "eval" / "results.md").read_text()
    rows = list(csv.DictReader(open(tmp_path / "eval" / "results.csv")))
    for m in results["models"]:
        assert f"| {m['name']} |" in markdown
        for n in LENGTHS:
            assert any(r["model"] == m["name"] and r["length"] == str(n) and r["metric"] == "loss" for r in rows)
    header = markdown.split("## Loss by context length")[1].strip().splitlines()[0]
    assert header == "| model | 16 | **32** (train) | 64 | 128 |"
    assert "†" in markdown and "## Passkey accuracy" in markdown and "## Counting L1" in markdown
    assert "![loss_vs_length.png](loss_vs_length.png)" in markdown


def test_csv_carries_the_loss_interval_and_ruler_rows(tmp_path):
    results = fake_results()
    results["models"][1]["lengths"][0]["ci95"] = [3.1, 3.3]
    results["models"][1]["ruler"] = [{"task": "niah", "length": 16, "depth": 0.5, "score": 0.75, "samples": 4,
                                      "scores": [1, 1, 1, 0], "ci95": [0.3, 0.95], "metric": "string_match_all"},
                                     {"task": "cwe", "length": 32, "depth": None, "score": 0.5, "samples": 2,
                                      "scores": [0.4, 0.6]}]
    write_report(results, tmp_path / "eval")
    rows = list(csv.DictReader(open(tmp_path / "eval" / "results.csv")))
    loss = [r for r in rows if r["model"] == "avnorm" and r["metric"] == "loss" and r["length"] == str(LENGTHS[0])]
    assert [(r["ci95_lo"], r["ci95_hi"]) for r in loss] == [("3.1", "3.3")]
    ruler = [(r["task"], r["metric"], r["length"], r["depth"], r["value"], r["count"], r["ci95_lo"], r["ci95_hi"])
             for r in rows if r["task"] in ("niah", "cwe")]
    assert ruler == [("niah", "string_match_all", "16", "0.5", "0.75", "4", "0.3", "0.95"),
                     ("cwe", "score", "32", "", "0.5", "2", "", "")]


def test_tables_without_optional_tasks_or_training_length():
    results = fake_results()
    results["train_len"] = None
    for m in results["models"]:
        del m["passkey"], m["counting"]
    table = loss_table_markdown(results)
    assert "(train)" not in table and table.count("\n| ") == 2  # header row + separator, then two models
    assert {r["task"] for r in tidy_rows(results)} == {"lm"}


def test_schema_accepts_results_and_names_what_is_wrong():
    validate(fake_results())
    for break_it, message in [
        (lambda r: r.pop("models"), "missing key 'models'"),
        (lambda r: r["models"][0]["lengths"][0].update(loss="3.2"),
         r"models\[0\]\.lengths\[0\]\.loss: expected number"),
        (lambda r: r["models"][1]["lengths"][2].update(beyond_max_positions=1), "expected boolean"),
        (lambda r: r["models"][0]["lengths"][0].update(windows=True), "expected integer"),
        (lambda r: r["models"][0]["passkey"][0].update(accuracy=1.5), "outside"),
        (lambda r: r.update(schema="retrofit.eval/0"), "not one of"),
    ]:
        results = fake_results()
        break_it(results)
        with pytest.raises(RetrofitError, match=message):
            validate(results)


def test_schema_is_valid_json_schema_and_agrees_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(RESULTS_SCHEMA)
    jsonschema.validate(fake_results(), RESULTS_SCHEMA)
    broken = copy.deepcopy(fake_results())
    broken["models"][0]["lengths"][0]["loss"] = None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RESULTS_SCHEMA)


def test_schema_document_names_every_field():
    doc = (Path(__file__).parents[2] / "docs" / "results-schema.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", doc))

    def fields(schema):
        for key, sub in schema.get("properties", {}).items():
            yield key
            yield from fields(sub)
        if "items" in schema:
            yield from fields(schema["items"])

    missing = set(fields(RESULTS_SCHEMA)) - documented
    assert not missing, f"docs/results-schema.md does not describe {sorted(missing)}"


def test_length_plots_mark_the_training_length_and_a_shared_position_limit():
    from retrofit.evaluate.report import length_marks
    results = fake_results()  # trained at 32, both models have 64 positions, evaluated up to 128
    assert length_marks(results) == [(32, "train length"), (64, "max_position_embeddings")]
    results["models"][1]["max_position_embeddings"] = 128  # no shared limit: only the training length
    assert length_marks(results) == [(32, "train length")]
    results = fake_results()
    results["lengths"] = [16, 32, 64]  # the limit is the last length: nothing beyond it to mark
    results["train_len"] = None
    assert length_marks(results) == []


# ---- what a results file says is shown as text, never rendered as markup -----------------------------------------

HOSTILE = "<img src=x onerror=alert(1)>\n# Owned | cell"  # a model name as a results.json may hold it


def _cells(line: str) -> int:
    return len(re.split(r"(?<!\\)\|", line))


def assert_renders_as_text(text: str) -> None:
    """No HTML tag, no heading made of a value, and every table row with its header's number of cells."""
    assert "<img" not in text and "<b>" not in text and "<i>" not in text, text
    assert not re.search(r"^#+ (Owned|h)\b", text, re.M), text
    for block in re.findall(r"(?:^\|.*\n)+", text, re.M):
        assert len({_cells(line) for line in block.splitlines()}) == 1, block


def test_names_from_a_results_file_render_as_text_in_results_md(tmp_path):
    """A model's name, source and data files from results.json: escaped in results.md (`retrofit report DIR`
    rewrites it from whatever results.json says), kept as they are in results.json."""
    results = fake_results()
    results["models"][1]["name"] = HOSTILE
    results["models"][1]["source"] = "runs/x`\n## h"
    results["data"]["files"] = ["<b>book</b>.txt"]
    write_report(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert_renders_as_text(text)
    assert "&lt;img src=x onerror=alert(1)&gt;" in text  # shown, as text
    assert json.loads((tmp_path / "results.json").read_text())["models"][1]["name"] == HOSTILE


def test_a_plot_of_many_panels_stays_within_the_pixel_budget(tmp_path):
    """One panel per model: 40 models (the fair test) drew a 2160 x 6720 PNG of 3 MB at 120 dpi. A small figure keeps
    its dpi; a large one is drawn at the dpi that fits MAX_PIXELS."""
    import struct

    from retrofit.evaluate.report import MAX_PIXELS, _figure, save_png

    def pixels(path):
        width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR chunk
        return width, height

    small = save_png(_figure(1)[0], tmp_path / "small.png")
    assert pixels(small) == (720, 480)  # 6 x 4 inches at 120 dpi, as before
    large = save_png(_figure(40)[0], tmp_path / "large.png")
    width, height = pixels(large)
    assert width * height <= MAX_PIXELS and width >= 1000  # still readable: 3 panels across
