"""One rule for damaged inputs (issue 36): config.retrofit is checked against a typed schema, config.json's values
before anything is built, a plain folder's weights like a checkpoint's, patch tensors for NaN. The CLI cases are
in tests/cli/test_bad_inputs.py; these check the rules themselves, and that nothing retrofit writes is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import retrofit
from retrofit.errors import RetrofitError
from retrofit.load import load
from retrofit.load.validate import check_record
from retrofit.record import read_record
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _record(norm="avnorm", **options):
    model = tiny_model("llama")
    retrofit.patch(model, norm, **options)
    return copy.deepcopy(read_record(model))


@pytest.mark.parametrize("field,value,match", [
    ("nope", "false", r"retrofit.nope must be true or false \(a JSON boolean, not a string\), got 'false'"),
    ("nope", 0, r"retrofit.nope must be true or false"),
    ("base_attn_implementation", "org/kernel", r"base_attn_implementation must be one of sdpa, eager"),
    ("base_attn_implementation", "paged|sdpa", r"base_attn_implementation must be one of"),
    ("format", "2", r"retrofit.format must be an integer >= 1, got '2'"),
    ("format", True, r"retrofit.format must be an integer >= 1, got True"),
    ("norm", "avnrm", r"retrofit.norm must be one of avnorm, "),
    ("options", ["kind"], r"retrofit.options must be a mapping"),
    ("layers", [0, "1"], r"retrofit.layers must be null or a list of indices >= 0"),
    ("heads", [-1], r"retrofit.heads must be null or a list of indices >= 0"),
    ("rope", {"factor": 4}, r"retrofit.rope must be null or a mapping with 'parameters'"),
    ("calibration", "yes", r"retrofit.calibration must be null or a mapping"),
    ("surprise", 1, r"retrofit has no field 'surprise'"),
    ("gate", "head", r"retrofit.gate must be null or a mapping \{kind, start, inputs\}, got 'head'"),
    ("gate", {"kind": "head", "start": -1}, r"gate start must be a number > 0"),  # the spec's own check
    ("gate", {"kind": "head", "start": 1e39}, r"gate start 1e\+39 is outside 1e-06\.\.1000"),  # issue 61: NaN logits
])
def test_a_record_field_of_the_wrong_type_is_refused_naming_it(field, value, match):
    record = _record()
    record[field] = value
    with pytest.raises(RetrofitError, match=match):
        check_record(record, "x/config.json")


@pytest.mark.parametrize("norm,key,value,match", [
    ("softmax1", "learnable", "true", r"retrofit.options.learnable must be true or false, got 'true'"),
    ("softmax1", "learnable", 1, r"retrofit.options.learnable must be true or false, got 1"),
    ("psoftmax", "p", "2", r"retrofit.options.p must be a number, got '2'"),
    ("psoftmax", "gain", "1.5", r"retrofit.options.gain must be a number or null, got '1.5'"),
    ("avnorm", "kind", 3, r"retrofit.options.kind must be a string, got 3"),
    ("avnorm", "eps", True, r"retrofit.options.eps must be a number, got True"),
    ("psoftmax", "p", 0.5, r"p must be a finite number >= 1"),  # in range: the norm's own check
    ("avnorm", "knd", "rms", r"has no option 'knd'"),
])
def test_a_wrong_typed_option_is_refused_never_coerced(norm, key, value, match):
    record = _record(norm)
    record["options"][key] = value
    with pytest.raises(RetrofitError, match=match):
        check_record(record, "x/config.json")


@pytest.mark.parametrize("norm,kwargs", [
    ("avnorm", {"floor": float("inf")}), ("avnorm", {"mode": "beyond"}), ("psoftmax", {"p": 2.0, "gain": 1.0}),
    ("ssmax", {"layers": "1", "heads": "0,2"}), ("softmax1", {"learnable": True}), ("softmax", {"rope": "yarn:2"}),
    ("avnorm", {"gate": "head:0.5:12"}), ("psoftmax", {"p": 2.0, "gate": "element"}),
])
def test_every_record_retrofit_writes_passes_and_round_trips(norm, kwargs, tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, norm, **kwargs)
    check_record(read_record(model), "x")
    model.save_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(retrofit.from_pretrained(str(tmp_path / "ckpt"))(random_ids()).logits,
                           model(random_ids()).logits)


def test_a_nan_patch_parameter_is_refused_at_load(tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    with torch.no_grad():
        model.model.layers[1].self_attn.retrofit.gain[2] = float("nan")
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(RetrofitError, match=r"patch tensor model.layers.1.self_attn.retrofit.gain holds NaN"):
        retrofit.from_pretrained(str(tmp_path / "ckpt"))


def test_a_plain_folder_missing_a_weight_is_refused_not_patched_with_it_random(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    tensors = load_file(str(tmp_path / "plain" / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "plain" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RetrofitError, match=r"weights missing model.layers.1.mlp.down_proj.weight"):
        load(str(tmp_path / "plain"))


def test_buffers_older_checkpoints_saved_are_not_extra_weights(tmp_path):
    """GPT-2 checkpoints carry attn.masked_bias, older Llamas rotary_emb.inv_freq: buffers, not weights."""
    for family, key in (("gpt2", "transformer.h.0.attn.masked_bias"),
                        ("llama", "model.layers.0.self_attn.rotary_emb.inv_freq")):
        model = tiny_model(family)
        model.save_pretrained(tmp_path / family)
        tensors = load_file(str(tmp_path / family / "model.safetensors"))
        tensors[key] = torch.zeros(4)
        save_file(tensors, str(tmp_path / family / "model.safetensors"), metadata={"format": "pt"})
        with torch.no_grad():
            assert torch.equal(load(str(tmp_path / family))(random_ids()).logits, model(random_ids()).logits)


def test_config_json_is_checked_before_any_module_is_built(tmp_path, monkeypatch):
    """0 heads would divide by zero in transformers' config class, 10**12 GPT-2 positions allocate a table: both
    are refused from the JSON, before transformers reads it."""
    from transformers import AutoModelForCausalLM
    tiny_model("gpt2").save_pretrained(tmp_path / "gpt2")
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({**config, "n_positions": 10**12}))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(RetrofitError, match=r"gpt2/config.json: n_positions must be an integer in 1..16,777,216"):
        load(str(tmp_path / "gpt2"))


def test_an_adapters_record_and_patch_tensors_are_checked_like_a_checkpoints(tmp_path):
    """retrofit.json of an adapter is the same record as config.retrofit: typed, and its tensors finite."""
    from retrofit.load.adapters import load_adapter, save_adapter
    from tests.load.test_adapters import peft_on_patched
    model, _, _ = peft_on_patched(tmp_path)  # a LoRA on a calibrated AVNorm base
    folder = save_adapter(model, tmp_path / "adapter")
    meta = json.loads((folder / "retrofit.json").read_text())
    meta["patch"]["nope"] = "false"
    (folder / "retrofit.json").write_text(json.dumps(meta))
    with pytest.raises(RetrofitError, match=r"retrofit.json: retrofit.nope must be true or false"):
        load_adapter(str(folder))
    meta["patch"]["nope"] = False
    (folder / "retrofit.json").write_text(json.dumps(meta))
    tensors = load_file(str(folder / "retrofit.safetensors"))
    key = sorted(tensors)[0]
    tensors[key][0] = float("nan")
    save_file(tensors, str(folder / "retrofit.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RetrofitError, match=rf"retrofit.safetensors: patch tensor {key} holds NaN"):
        load_adapter(str(folder))
