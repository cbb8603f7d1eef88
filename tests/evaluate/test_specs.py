"""The evaluation and diagnose specs (issue 27 item 4): each is checked when it is made (no source named, no model
loaded), normalizes what its function reads, and is the very dataclass the command line fills."""

from __future__ import annotations

import pytest

import retrofit.diagnose as diagnose_library
import retrofit.evaluate as evaluate_library
import retrofit.evaluate.report as report_library
from retrofit.cli import main
from retrofit.diagnose import DiagnoseSpec
from retrofit.errors import RetrofitError
from retrofit.evaluate import EvalSpec
from tests.tiny import tiny_model


@pytest.mark.parametrize("fields, message", [
    (dict(tasks=["lm", "perplexity"]), r"unknown tasks \['perplexity'\]: choose from lm, passkey, counting"),
    (dict(rope="yarn:4", variants=[{"name": "a"}]), "give either variants or one patch/rope for every model"),
    (dict(patch={"kind": "rms"}), "the evaluation patch needs a norm"),
    (dict(patch={"norm": "avnorm", "kinf": "rms"}), "kinf"),
    (dict(variants=[{"name": "a"}, {"name": "a"}]), "two variants are named 'a'"),
    (dict(variants=[{"name": "a", "patchh": {}}]), r"variant 'a' has unknown keys \['patchh'\]"),
])
def test_eval_spec_refuses_bad_settings_when_made(fields, message):
    with pytest.raises(RetrofitError, match=message) as err:
        EvalSpec(lengths=[16], **fields)
    assert "\n" not in str(err.value)


def test_eval_spec_normalizes_what_evaluate_models_reads():
    spec = EvalSpec(lengths=[64, 16, 64], data="book.txt", patch={"norm": "avnorm", "kind": "rms"}, rope="yarn:4")
    assert spec.lengths == [16, 64] and spec.data == ["book.txt"]
    [(variant, patch)] = spec.patches
    assert variant is None and patch["norm"] == "avnorm" and patch["options"]["kind"] == "rms"
    assert patch["rope"]["rope_type"] == "yarn" and patch["rope"]["factor"] == 4
    assert EvalSpec(lengths="16,32,...,128").lengths == [16, 32, 64, 128]
    assert EvalSpec(lengths=[16]).patches == [(None, None)]  # nothing to patch on the fly
    named = EvalSpec(lengths=[16], variants=[{"name": "plain"}, {"name": "yarn2", "rope": "yarn:2"}]).patches
    assert [name for name, _ in named] == ["plain", "yarn2"] and named[0][1] is None


@pytest.mark.parametrize("fields, message", [
    (dict(windows=0), r"--windows and --queries must be >= 1"),
    (dict(queries=0), r"--windows and --queries must be >= 1"),
    (dict(patches=["avnrm"]), "avnrm"),
    (dict(patches=["avnorm:kind"]), "options are key=value"),
])
def test_diagnose_spec_refuses_bad_settings_when_made(fields, message, tmp_path):
    with pytest.raises(RetrofitError, match=message) as err:
        DiagnoseSpec(data="book.txt", out=str(tmp_path / "never"), lengths=[8, 16], **fields)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "never").exists()


def test_diagnose_spec_normalizes_lengths_and_patches():
    spec = DiagnoseSpec(data="book.txt", out="diag", lengths="8,16,...,64", patches=("avnorm", "psoftmax:p=2"))
    assert spec.lengths == [8, 16, 32, 64] and spec.patches == ["avnorm", "psoftmax:p=2"]
    assert spec.norms == ["avnorm", "psoftmax"]


@pytest.fixture
def model_folder(tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(path)
    (tmp_path / "book.txt").write_text("a few words of text " * 20)
    return path


def test_the_eval_command_fills_an_eval_spec(model_folder, tmp_path, monkeypatch):
    seen = []
    # the command imports them when it runs (its module imports nothing heavy): patch where they live
    monkeypatch.setattr(evaluate_library, "evaluate_models", lambda sources, spec: seen.append((sources, spec)) or
                        {"models": []})
    monkeypatch.setattr(report_library, "write_report", lambda results, out: [])
    assert main(["eval", str(model_folder), str(model_folder), "--data", str(tmp_path / "book.txt"),
                 "--lengths", "16,32", "--tasks", "lm", "--names", "a,b", "--rope", "yarn:2", "--batch-tokens", "64",
                 "--no-progress", "--device", "cpu", "--out", str(tmp_path / "eval")]) == 0
    [(sources, spec)] = seen
    assert type(spec) is EvalSpec and sources == [str(model_folder)] * 2
    assert (spec.lengths, spec.names, spec.tasks, spec.batch_tokens, spec.progress) == \
        ([16, 32], ["a", "b"], ["lm"], 64, False)
    assert spec.data == [str(tmp_path / "book.txt")] and spec.patches[0][1]["rope"]["factor"] == 2


def test_the_diagnose_command_fills_a_diagnose_spec(model_folder, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(diagnose_library, "diagnose_sources", lambda sources, spec: seen.append((sources, spec)))
    assert main(["diagnose", str(model_folder), "--data", str(tmp_path / "book.txt"), "--lengths", "8,16",
                 "--windows", "3", "--patch", "avnorm", "--label", "tiny", "--quiet",
                 "--out", str(tmp_path / "diag")]) == 0
    [(sources, spec)] = seen
    assert type(spec) is DiagnoseSpec and sources == [str(model_folder)]
    assert (spec.lengths, spec.windows, spec.patches, spec.labels, spec.progress) == \
        ([8, 16], 3, ["avnorm"], ["tiny"], False)
