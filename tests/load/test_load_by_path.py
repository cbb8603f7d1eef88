"""Load by path where users load (issue 53): after `retrofit.enable()` (or `import retrofit.auto`) transformers' own
loaders hand a retrofit checkpoint to retrofit's loader and give exactly the patched model (logits equal to
retrofit.from_pretrained); without it they refuse it, in retrofit's words. Plain models load as before either way.

One folder per module (a patched tiny Llama whose patch parameters are not the norm's defaults, with a tokenizer and
a PEFT adapter on it); each tool's model is compared with retrofit.from_pretrained's, bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, pipeline

import retrofit
from retrofit.errors import RetrofitError
from tests.tiny import char_tokenizer, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

IDS = random_ids(2, 12)
WORDS = r"retrofit\.enable\(\)"  # the refusal names the switch


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _moved(model, pattern: str, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if pattern in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{'model': a saved SSMax checkpoint, 'adapter': a PEFT adapter (LoRA + trained patch) saved by PEFT itself on
    it, 'plain': an unpatched model}, each with the character tokenizer."""
    from peft import LoraConfig, get_peft_model
    root = tmp_path_factory.mktemp("by-path")
    model = tiny_model("llama")
    retrofit.patch(model, "ssmax")
    _moved(model, ".retrofit.", seed=3, scale=0.5)  # a dropped patch shows in the logits
    model.save_pretrained(root / "model")
    tiny_model("llama", seed=1).save_pretrained(root / "plain")
    base = retrofit.from_pretrained(str(root / "model"))
    peft = get_peft_model(base, retrofit.peft_config(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                                       task_type="CAUSAL_LM")))
    _moved(peft, "lora_B", seed=4, scale=0.1)
    _moved(peft, "modules_to_save", seed=5, scale=0.3)
    peft.save_pretrained(root / "adapter")
    for name in ("model", "plain", "adapter"):
        char_tokenizer().save_pretrained(root / name)
    return {name: root / name for name in ("model", "plain", "adapter")}


@pytest.fixture
def enabled():
    retrofit.enable()
    yield
    retrofit.disable()


def _auto(path):
    return AutoModelForCausalLM.from_pretrained(str(path))


def _pipeline(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipeline("text-generation", model=str(path), device="cpu").model


def _auto_peft(path):
    from peft import AutoPeftModelForCausalLM
    return AutoPeftModelForCausalLM.from_pretrained(str(path))


def _lm_eval(path):
    lm_eval = pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval is in the test extra")
    return lm_eval.HFLM(pretrained=str(path), device="cpu", batch_size=1).model


# tool -> (its loader, the folder it is given)
TOOLS = {"AutoModelForCausalLM": (_auto, "model"), "pipeline": (_pipeline, "model"),
         "AutoPeftModelForCausalLM": (_auto_peft, "adapter"), "lm-eval hf": (_lm_eval, "model")}


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_tool_loads_exactly_the_patched_model_once_enabled(tool, folders, enabled):
    load, which = TOOLS[tool]
    expected = _logits(retrofit.from_pretrained(str(folders[which])))
    model = load(folders[which])
    assert retrofit.is_patched(model.get_base_model() if hasattr(model, "get_base_model") else model)
    assert torch.equal(_logits(model), expected), tool


@pytest.mark.parametrize("tool", list(TOOLS))
def test_without_the_switch_each_tool_refuses_in_retrofit_words(tool, folders):
    load, which = TOOLS[tool]
    with pytest.raises(Exception, match=WORDS):
        load(folders[which])


def test_plain_models_load_as_before_when_enabled(folders, enabled):
    """The switch changes nothing for a model without a patch record: the same class, the same logits, and
    from_config builds the same model."""
    model = _auto(folders["plain"])
    retrofit.disable()
    reference = _auto(folders["plain"])
    retrofit.enable()
    assert type(model) is type(reference) and not retrofit.is_patched(model)
    assert torch.equal(_logits(model), _logits(reference))
    config = AutoConfig.from_pretrained(str(folders["plain"]))
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(config)
    assert type(fresh) is type(reference) and not retrofit.is_patched(fresh)


def test_a_composite_config_gets_its_text_part_as_without_the_switch(enabled):
    """AutoModelForCausalLM builds Llama4ForCausalLM from a Llama4Config's text part (the Auto classes swap configs
    for such classes); the loader registered for it must make the same swap."""
    from tests.tiny import COVERAGE
    config = AutoConfig.for_model("llama4", text_config=dict(COVERAGE["llama4_text"]))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    retrofit.disable()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    retrofit.enable()
    assert type(model) is type(reference) and type(model.config) is type(reference.config)
    assert model.state_dict().keys() == reference.state_dict().keys()


def test_a_config_with_its_own_code_is_refused_not_built_as_the_builtin_class(enabled):
    from tests.tiny import TINY
    config = AutoConfig.for_model("llama", **TINY["llama"])
    config.auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    with pytest.raises(RetrofitError, match="ships its own code"):
        AutoModelForCausalLM.from_config(config)


def test_from_config_of_a_patched_config_builds_the_patched_architecture(folders, enabled):
    config = AutoConfig.from_pretrained(str(folders["model"]))
    model = AutoModelForCausalLM.from_config(config)
    assert retrofit.is_patched(model) and retrofit.patch_record(model)["norm"] == "ssmax"


def test_an_explicit_attn_implementation_patches_over_it(folders, enabled):
    """Without the switch, attn_implementation="eager" loaded the original model (config.json cannot stop an
    explicit argument); with it, the patch is rebuilt over eager: the same model as retrofit's loader gives."""
    model = AutoModelForCausalLM.from_pretrained(str(folders["model"]), attn_implementation="eager")
    expected = retrofit.from_pretrained(str(folders["model"]), attn_implementation="eager")
    assert retrofit.is_patched(model)
    assert torch.equal(_logits(model), _logits(expected))


def test_disable_restores_the_refusal_and_enable_is_idempotent(folders):
    retrofit.enable()
    retrofit.enable()
    assert retrofit.is_patched(_auto(folders["model"]))
    retrofit.disable()
    with pytest.raises(ValueError, match=WORDS):
        _auto(folders["model"])


def test_remote_code_stays_refused_when_enabled(folders, enabled):
    with pytest.raises(RetrofitError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(str(folders["model"]), trust_remote_code=True)


def test_a_folder_with_the_guard_of_earlier_retrofits_loads_by_path_too(folders, tmp_path, enabled):
    """Folders saved before issue 53 carry attn_implementation "retrofit.from_pretrained": still a guard (refused
    without the switch), and loaded exactly with it; re-saved, they carry today's guard."""
    import json
    import shutil

    from retrofit.record import GUARD
    old = tmp_path / "old"
    shutil.copytree(folders["model"], old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "attn_implementation": "retrofit.from_pretrained"}))
    model = _auto(old)
    assert torch.equal(_logits(model), _logits(retrofit.from_pretrained(str(folders["model"]))))
    model.save_pretrained(tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["attn_implementation"] == GUARD
    retrofit.disable()
    with pytest.raises(ValueError, match="retrofit.from_pretrained"):
        _auto(old)
    retrofit.enable()


def test_trl_sft_trainer_by_path_is_refused_in_retrofit_words_even_when_enabled(folders, tmp_path, enabled):
    """TRL's SFTTrainer(model=path) builds `transformers.<config.architectures[0]>` itself, a concrete class that no
    Auto registration reaches: the guard refuses it. Handing it the model loaded by path is the way in."""
    trl = pytest.importorskip("trl", reason="TRL is in the test extra")
    from datasets import Dataset
    data = Dataset.from_dict({"text": ["abc abc abc"] * 4})
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1,
                         per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=WORDS):
        trl.SFTTrainer(model=str(folders["model"]), args=args, train_dataset=data)
    trainer = trl.SFTTrainer(model=_auto(folders["model"]), args=args, train_dataset=data,
                             processing_class=char_tokenizer())
    assert retrofit.is_patched(trainer.model)


def test_enable_and_disable_from_8_threads_never_chain_and_disable_restores_exactly():
    """Issue 61: 8 threads calling retrofit.enable() at once registered loaders over loaders (a loader's `previous`
    another loader), so disable() left the switch on (1 trial in 20), and a loop over the registrations once met
    another thread's writes. Every round, 8 threads enable together (a barrier), each checks the chain, then all
    disable together; a class the user registered before enable() is the one registered after disable()."""
    import sys
    import threading

    from transformers import LlamaConfig, LlamaForCausalLM

    from retrofit.integrations.auto_classes import _is_loader, _registered, is_enabled

    mine = type("UsersLlama", (LlamaForCausalLM,), {})  # the user's own registration, from before the switch
    saved = dict(_registered())
    AutoModelForCausalLM.register(LlamaConfig, mine, exist_ok=True)
    before = dict(_registered())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch every microsecond: the races show in a few rounds
    rounds, barrier, problems = 10, threading.Barrier(8), []

    def worker():
        try:
            for _ in range(rounds):
                barrier.wait()
                retrofit.enable()
                chained = [c.__name__ for c, v in list(_registered().items())
                           if _is_loader(v) and _is_loader(v.previous)]
                if chained or not is_enabled():
                    problems.append(chained or "not enabled after enable()")
                barrier.wait()
                retrofit.disable()
        except Exception as err:  # "dictionary changed size during iteration", a broken barrier
            problems.append(repr(err))
            barrier.abort()

    try:
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not problems, problems[:3]
        assert not is_enabled()
        assert _registered() == before and _registered()[LlamaConfig] is mine  # exactly what was there, no loader
    finally:
        sys.setswitchinterval(interval)
        _registered().clear()
        _registered().update(saved)
