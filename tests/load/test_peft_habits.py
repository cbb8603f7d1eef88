"""transformers/PEFT habits on patched models (issue 40): `retrofit.peft_config` makes plain `get_peft_model` train
the norm's own parameters; an adapter saved by PEFT's own `save_pretrained` on a retrofit checkpoint loads with
`retrofit.from_pretrained` and `retrofit eval`; `from_pretrained` forwards transformers' loading arguments;
`calibrate` takes the token-id shapes people pass."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import retrofit
from retrofit.cli import main
from retrofit.errors import RetrofitError
from tests.tiny import char_tokenizer, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# norm -> (options, the parameter names the patch adds: each must train)
NORMS = {"avnorm": ({}, {"gain"}), "ssmax": ({}, {"s"}), "softmax1": ({"learnable": True}, {"sink"})}


def _patch_params(model, trainable_only: bool = False) -> dict:
    return {n: p for n, p in model.named_parameters() if ".retrofit." in n and (p.requires_grad or not trainable_only)}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_peft_config_makes_get_peft_model_train_the_norms_parameters(norm, tmp_path):
    options, names = NORMS[norm]
    base = tiny_model("llama")
    retrofit.patch(base, norm, **options)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    plain = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert not _patch_params(plain)  # (an unpatched model has none: nothing to add)

    model = get_peft_model(base, retrofit.peft_config(base, lora))
    trainable = _patch_params(model, trainable_only=True)
    assert {n.rsplit(".", 1)[-1] for n in trainable} == names and len(trainable) == 2 * len(names)  # 2 layers
    ids = random_ids(2, 12)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())

    with torch.no_grad():  # a training step moved them: PEFT's own save_pretrained keeps the trained copies
        for p in trainable.values():
            p.add_(0.25)
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sum(".retrofit." in k for k in saved) == len(trainable)


def test_peft_config_refuses_an_unpatched_model():
    with pytest.raises(RetrofitError, match="not patched"):
        retrofit.peft_config(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))


@pytest.fixture
def peft_saved_adapter(tmp_path):
    """A patched checkpoint (trained-looking gains) and an adapter PEFT alone saved on it (LoRA + modules_to_save)."""
    base = tiny_model("llama")
    retrofit.patch(base, "avnorm")
    with torch.no_grad():
        for p in _patch_params(base).values():
            p.mul_(1.7)
    base.save_pretrained(tmp_path / "base")
    char_tokenizer().save_pretrained(tmp_path / "base")
    loaded = retrofit.from_pretrained(str(tmp_path / "base"))
    model = get_peft_model(loaded, retrofit.peft_config(
        loaded, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "adapter")  # PEFT's own: no retrofit.json
    char_tokenizer().save_pretrained(tmp_path / "adapter")
    ids = random_ids(2, 10)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    return tmp_path / "adapter", ids, expected


def test_a_peft_saved_adapter_on_a_checkpoint_loads_with_from_pretrained(peft_saved_adapter):
    folder, ids, expected = peft_saved_adapter
    assert not (folder / "retrofit.json").exists()
    model = retrofit.from_pretrained(str(folder))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected)


def test_a_peft_saved_adapter_evaluates(peft_saved_adapter, tmp_path):
    folder, _, _ = peft_saved_adapter
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 8)
    assert main(["eval", str(folder), "--data", str(text), "--lengths", "16", "--no-progress", "--device", "cpu",
                 "--out", str(tmp_path / "eval")]) == 0
    assert (tmp_path / "eval" / "results.json").is_file()


def test_a_peft_adapter_on_an_unpatched_base_says_what_to_do(tmp_path):
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(RetrofitError, match="not a retrofit checkpoint") as err:
        retrofit.from_pretrained(str(tmp_path / "adapter"))
    assert "\n" not in str(err.value)


# ---- item 4: transformers' loading arguments, calibrate's inputs ---------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    model.save_pretrained(tmp_path / "ckpt")
    return str(tmp_path / "ckpt")


def test_from_pretrained_forwards_transformers_loading_arguments(checkpoint, monkeypatch):
    import transformers
    seen = {}
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    model = retrofit.from_pretrained(checkpoint, torch_dtype=torch.bfloat16, low_cpu_mem_usage=True,
                                     use_safetensors=True)
    assert next(model.parameters()).dtype == torch.bfloat16  # torch_dtype: dtype's deprecated alias
    assert seen["low_cpu_mem_usage"] is True and seen["use_safetensors"] is True
    assert retrofit.is_patched(model)
    with pytest.raises(RetrofitError, match="disagree"):
        retrofit.from_pretrained(checkpoint, dtype="float32", torch_dtype=torch.bfloat16)
    with pytest.raises(RetrofitError, match="config: retrofit sets it itself"):
        retrofit.from_pretrained(checkpoint, config=model.config)


def _gains(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith(".retrofit.gain")])


@pytest.mark.parametrize("form", ["2d tensor", "1d tensor", "list of 1d", "list of (1, T)", "list of dicts",
                                  "dict", "batch encoding"])
def test_calibrate_takes_the_shapes_people_pass(form):
    from transformers import BatchEncoding
    ids = random_ids(2, 16)
    forms = {"2d tensor": ids, "1d tensor": ids[0], "list of 1d": list(ids), "list of (1, T)": [r[None] for r in ids],
             "list of dicts": [{"input_ids": r[None]} for r in ids], "dict": {"input_ids": ids},
             "batch encoding": BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})}
    reference, model = tiny_model("llama"), tiny_model("llama")
    for m in (reference, model):
        retrofit.patch(m, "avnorm")
    retrofit.calibrate(reference, [ids[:1], ids[1:]] if form != "1d tensor" else [ids[:1]])
    summary = retrofit.calibrate(model, forms[form])
    assert summary["tokens"] == (16 if form == "1d tensor" else 32)
    torch.testing.assert_close(_gains(model), _gains(reference))


def test_calibrate_refuses_what_is_not_token_ids():
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    for bad, message in ((torch.randn(2, 8), "must be integers"), (torch.zeros(1, 2, 8, dtype=torch.long), "(T,)"),
                         (["some text"], "LongTensors or dicts")):
        with pytest.raises(RetrofitError, match=message.replace("(", r"\(").replace(")", r"\)")):
            retrofit.calibrate(model, bad)
