"""config.retrofit is written by retrofit/record.py alone; write_record fills the schema and refuses unknown
fields."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import retrofit
from retrofit.errors import RetrofitError
from retrofit.record import FIELDS, read_record, write_record
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


ROOT = Path(retrofit.__file__).parent


def _retrofit_stores(tree) -> list[int]:
    """Lines that assign or delete `<x>.retrofit` or `<x>.retrofit[...]`."""
    lines = []
    for node in ast.walk(tree):
        target = node.value if isinstance(node, ast.Subscript) else node
        if (isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(target, ast.Attribute) and target.attr == "retrofit"):
            lines.append(node.lineno)
    return lines


def test_only_the_record_module_assigns_config_retrofit():
    writers = {}
    for path in ROOT.rglob("*.py"):
        lines = _retrofit_stores(ast.parse(path.read_text()))
        if lines and path.name != "record.py":
            writers[str(path.relative_to(ROOT.parent))] = lines
    assert writers == {}
    assert _retrofit_stores(ast.parse("m.config.retrofit = {}\nc.retrofit['norm'] = 'x'\n")) == [1, 2]  # not vacuous


def test_write_record_fills_the_schema_and_refuses_unknown_fields():
    model = tiny_model("llama")
    record = write_record(model, norm="ssmax")
    assert set(record) == set(FIELDS) and record["format"] == FIELDS["format"] and read_record(model) is record
    with pytest.raises(RetrofitError, match="no field calibraton"):
        write_record(model, calibraton={})
