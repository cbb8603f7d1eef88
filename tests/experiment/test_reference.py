"""Comparing an experiment with a published table: known-answer directions and one-line errors."""

from __future__ import annotations

import json

import pytest

from retrofit.errors import RetrofitError
from retrofit.experiment.reference import direction_markdown, directions, load_reference
from retrofit.recipe import ReferenceSection
from retrofit.recipe.schema import build

TABLE = {"context_lengths": [64, 128, 256, 512],
         "pe": {"l1": [3.0, 3.0, 3.0, 3.0], "rms": [3.2, 3.005, 2.5, 2.0]}}


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(TABLE))
    return path


def section(path, **kw):
    return build(ReferenceSection, {"file": str(path), "control": "pe.l1", "arms": {"avnorm": "pe.rms"}, **kw},
                 "experiment.reference")


def test_directions_known_answer(table):
    ref = load_reference(section(table), ["softmax", "avnorm"])
    ours = {"softmax": {64: 2.0, 128: 2.0, 256: 2.0, 1024: 2.0},
            "avnorm": {64: 2.1, 128: 1.5, 256: 1.0, 1024: 0.5}}
    rows = directions(ref, ours)["avnorm"]
    # 512 and 1024 are each in one table only; 128: ours -0.5, published +0.005 (a tie) -> differs
    assert [(r["length"], round(r["ours"], 6), round(r["theirs"], 6), r["agree"]) for r in rows] == [
        (64, 0.1, 0.2, True), (128, -0.5, 0.005, False), (256, -1.0, -0.5, True)]
    text = "\n".join(direction_markdown(ref, ours, train_len=64))
    assert "same direction at 2 of 3 shared lengths" in text
    assert "| 256 | 4 | -1.000 | -0.500 | agrees |" in text


def test_a_tie_on_both_sides_agrees(table):
    ref = load_reference(section(table, tie=0.2), ["softmax", "avnorm"])
    rows = directions(ref, {"softmax": {128: 2.0}, "avnorm": {128: 2.1}})["avnorm"]
    assert rows[0]["agree"]  # +0.1 ours and +0.005 published are both "no difference" at tie 0.2


def test_missing_values_are_skipped(table):
    ref = load_reference(section(table), ["softmax", "avnorm"])
    rows = directions(ref, {"softmax": {64: 2.0, 128: None}, "avnorm": {64: float("nan"), 128: 2.0}})["avnorm"]
    assert rows == []
    assert "no length in common" in "\n".join(direction_markdown(ref, {}, None))


@pytest.mark.parametrize("change,match", [
    ({"control": "pe.l2"}, r"no curve 'pe.l2' \(at 'l2'; keys there: l1, rms\)"),
    ({"arms": {"ssmax": "pe.rms"}}, "names arm 'ssmax', which is not among experiment.arms"),
    ({"control_arm": "base"}, "names arm 'base'"),
    ({"file": "nowhere.json"}, "nowhere.json not found"),
])
def test_bad_reference_is_refused_in_one_line(table, change, match):
    with pytest.raises(RetrofitError, match=match) as err:
        load_reference(section(table, **change), ["softmax", "avnorm"])
    assert "\n" not in str(err.value)


def test_malformed_tables_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    for content, match in [("{", "not valid JSON"), ('{"pe": {}}', "context_lengths"),
                           ('{"context_lengths": [1, 2], "pe": {"l1": [3.0], "rms": [1, 2]}}', "1 values for 2"),
                           ('{"context_lengths": [1], "pe": {"l1": "x", "rms": [1]}}', "not a list of numbers")]:
        bad.write_text(content)
        with pytest.raises(RetrofitError, match=match):
            load_reference(section(bad), ["softmax", "avnorm"])


@pytest.mark.parametrize("data,match", [
    ({"file": "x.json", "control": "pe.l1"}, "needs file, control and arms"),
    ({"file": "x.json", "control": "pe.l1", "arms": {"avnorm": 3}}, "map arm names to curve keys"),
    ({"file": "x.json", "control": "pe.l1", "arms": {"a": "b"}, "tie": -1.0}, "tie must be >= 0"),
])
def test_bad_reference_section(data, match):
    with pytest.raises(RetrofitError, match=match):
        build(ReferenceSection, data, "experiment.reference")
