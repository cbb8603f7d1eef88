"""`retrofit info PATH` / `retrofit.info(model_or_path)` (issue 40): what a folder is, read from its files."""

from __future__ import annotations

import json

import pytest
import torch

import retrofit
from retrofit.cli import main
from tests.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm", kind="layer", rope="linear:2", layers="1")
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_info_of_a_checkpoint_reads_its_files_without_loading_the_model(checkpoint, monkeypatch):
    _, folder = checkpoint
    import transformers
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("info loaded the model")))
    facts = retrofit.info(str(folder))
    assert (facts["kind"], facts["model_type"], facts["norm"], facts["options"]["kind"]) == \
        ("checkpoint", "llama", "avnorm", "layer")
    assert (facts["layers"], facts["heads"], facts["rope"], facts["dtype"]) == ("1", "all", "linear x2 (orig 64)",
                                                                               "float32")
    assert (facts["num_layers"], facts["num_heads"], facts["num_kv_heads"], facts["head_dim"]) == (2, 4, 2, 8)
    assert facts["parameters_added"] == 4  # one layer x 4 heads of gains
    assert facts["patch_parameters"].startswith("initial")


def test_info_tells_moved_patch_parameters_and_a_model_in_memory(checkpoint, tmp_path):
    model, _ = checkpoint
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".retrofit.gain"):
                p.add_(0.5)
    assert retrofit.info(model)["patch_parameters"].startswith("changed (gain")
    model.save_pretrained(tmp_path / "moved")
    assert retrofit.info(str(tmp_path / "moved"))["patch_parameters"].startswith("changed (gain")
    plain = tiny_model("gpt2")
    plain.save_pretrained(tmp_path / "plain")
    facts = retrofit.info(str(tmp_path / "plain"))
    assert (facts["kind"], facts["norm"], facts["parameters_added"]) == ("model", None, 0)


def test_info_reads_a_gate_and_whether_it_moved(tmp_path):
    """A gated checkpoint (issue 55): its gate in the facts, its zero-initialized weights 'initial' until they move."""
    model = tiny_model("llama")
    retrofit.patch(model, "softmax", gate="head:0.5:12")
    model.save_pretrained(tmp_path / "fresh")
    facts = retrofit.info(str(tmp_path / "fresh"))
    assert facts["gate"] == {"kind": "head", "start": 0.5, "inputs": 12}
    assert facts["patch_parameters"].startswith("initial") and facts["parameters_added"] == 2 * (4 * 12 + 4)
    with torch.no_grad():
        model.model.layers[0].self_attn.retrofit.gate.bias.add_(1.0)
    assert retrofit.info(model)["patch_parameters"] == "changed (gate.bias moved from the initial values: trained " \
                                                      "or calibrated)"


def test_retrofit_info_prints_lines_or_json(checkpoint, capsys):
    _, folder = checkpoint
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "norm:" in out and "avnorm" in out and "linear x2 (orig 64)" in out
    assert main(["info", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters_added"] == 4
    assert main(["info", str(folder / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
