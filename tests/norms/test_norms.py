"""The norm registry and the files in retrofit/norms/ agree; every norm documents its options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import retrofit
from retrofit.norms import NORMS, describe_norms

NORM_DIR = Path(retrofit.__file__).parent / "norms"


def test_registry_matches_files():
    shared = ("__init__", "base", "attention_call", "options")  # what every norm shares, not a norm
    files = {p.stem for p in NORM_DIR.glob("*.py") if p.stem not in shared}
    assert files == set(NORMS)
    for name, cls in NORMS.items():
        assert Path(__import__("sys").modules[cls.__module__].__file__).stem == name


def test_every_norm_documents_formula_and_options():
    for row in describe_norms():
        assert row["formula"] and row["summary"]
        for opt in row["options"]:
            assert opt["doc"], (row["name"], opt["name"])
    for cls in NORMS.values():
        assert cls.__module__ and __import__("sys").modules[cls.__module__].__doc__


def test_options_are_dataclasses_with_defaults():
    for name, cls in NORMS.items():
        cls.Options()  # every option has a default
        assert dataclasses.is_dataclass(cls.Options), name
