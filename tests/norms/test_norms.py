"""The norm registry and the files in retrofit/norms/ agree; every norm documents its options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import retrofit
from retrofit.norms import NORMS, describe_norms
from retrofit.norms.weights_only import WeightsOnlyNorm

NORM_DIR = Path(retrofit.__file__).parent / "norms"


def test_registry_matches_files():
    """Every file of norms/ but what norms share registers one norm named as the file, and the registering import is
    the one the regenerate command writes from the files (a new norm file is registered by that command)."""
    from retrofit.commands.patch_flags import norm_files, registering_line

    shared = ("__init__", "base", "attention_call", "options", "output_hook", "weights_only")  # shared, not norms
    files = {p.stem for p in NORM_DIR.glob("*.py") if p.stem not in shared}
    assert files == set(NORMS) == set(norm_files())
    path, text = registering_line()
    assert path.read_text() == text, "register the new file: python -m retrofit.commands.patch_flags"
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


# The norms whose parity tests predate one file per norm, and where each is (the list only shrinks: a norm registered
# since has tests/norms/test_<name>.py, as sigmoid does).
PARITY_ELSEWHERE = {
    "softmax": "tests/patch/test_patch.py::test_softmax_norm_is_bitwise_original",
    "psoftmax": "tests/kernels/test_kernels.py",
    "ssmax": "tests/kernels/test_kernels.py",
    "softmax1": "tests/kernels/test_kernels.py",
    "avnorm": "tests/patch/test_patch.py::test_parity_with_reference",
}


def test_every_norm_has_its_parity_test():
    """Each registered norm's forward is checked against an independent float64 formula in tests/norms/test_<name>.py
    (a weights-only norm's file also holds that formula, `reference_weights`, for tests/reference.py)."""
    tests = NORM_DIR.parents[1] / "tests"
    for name in NORMS:
        if name in PARITY_ELSEWHERE:
            path, _, test = PARITY_ELSEWHERE[name].partition("::")
            assert test in (tests.parent / path).read_text()
            continue
        own = tests / "norms" / f"test_{name}.py"
        assert own.is_file(), f"{name} needs its parity test, {own.relative_to(tests.parent)}"
        text = own.read_text()
        assert "float64" in text and "autograd.grad" in text, f"{own.name}: forward and gradients against float64"
        if issubclass(NORMS[name], WeightsOnlyNorm):  # tests/reference.py reads its formula from here
            assert "def reference_weights(s, allowed, n, options, params):" in text
