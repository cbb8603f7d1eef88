"""One loader (issue 27): `retrofit.load.load` takes what the user typed, `retrofit.from_pretrained` is its
transformers-shaped face, and both forward transformers' loading arguments to every transformers call."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import retrofit
from retrofit.errors import RetrofitError
from retrofit.load import load, sources
from tests.tiny import random_ids, tiny_model

HUB_ARGS = {"revision": "main", "token": "hf_not_a_real_token", "local_files_only": True}


@pytest.fixture
def spy(monkeypatch):
    """Every call of transformers' AutoConfig / AutoModelForCausalLM from_pretrained: (name, kwargs)."""
    calls = []
    for cls in (AutoConfig, AutoModelForCausalLM):
        original = cls.from_pretrained

        def recorded(*args, _original=original, _name=cls.__name__, **kwargs):
            calls.append((_name, kwargs))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", recorded)
    return calls


def _forwarded(calls, cache_dir, revision=HUB_ARGS["revision"]):
    """Each recorded call carried every loading argument unchanged, and trust_remote_code=False."""
    assert {name for name, _ in calls} == {"AutoConfig", "AutoModelForCausalLM"}, calls
    for name, kwargs in calls:
        for key, value in {**HUB_ARGS, "cache_dir": cache_dir, "revision": revision}.items():
            assert kwargs.get(key) == value, (name, key, kwargs.get(key))
        assert kwargs.get("trust_remote_code") is False, name


def test_load_forwards_transformers_arguments_for_a_plain_folder(tmp_path, spy):
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    model = load(str(tmp_path / "plain"), attn_implementation="eager", device_map="cpu", dtype="bfloat16",
                 cache_dir=str(tmp_path / "cache"), **HUB_ARGS)
    assert model.config._attn_implementation == "eager" and model.dtype == torch.bfloat16
    model_calls = [k for name, k in spy if name == "AutoModelForCausalLM"]
    assert model_calls[-1]["attn_implementation"] == "eager" and model_calls[-1]["device_map"] == "cpu"
    _forwarded(spy, str(tmp_path / "cache"))


def test_from_pretrained_forwards_them_for_a_checkpoint_and_eager_reaches_the_patch(tmp_path, spy):
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    model.save_pretrained(tmp_path / "ckpt")
    ids = random_ids(2, 12)
    with torch.no_grad():
        expected = model(ids).logits
    spy.clear()
    loaded = retrofit.from_pretrained(str(tmp_path / "ckpt"), attn_implementation="eager",
                                      cache_dir=str(tmp_path / "cache"), **HUB_ARGS)
    assert loaded.config.retrofit["base_attn_implementation"] == "eager"  # the kernel the patch now wraps
    assert [k["attn_implementation"] for name, k in spy if name == "AutoModelForCausalLM"] == ["eager"]
    _forwarded(spy, str(tmp_path / "cache"))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-4)  # eager and sdpa agree on the same weights
    default = retrofit.from_pretrained(str(tmp_path / "ckpt"))
    assert default.config.retrofit["base_attn_implementation"] == "sdpa"  # unnamed: the recorded kernel


def test_trust_remote_code_true_is_refused_in_one_line(tmp_path, spy):
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    for loader in (retrofit.from_pretrained, load):
        with pytest.raises(RetrofitError, match="trust_remote_code=True: retrofit never runs") as err:
            loader(str(tmp_path / "plain"), trust_remote_code=True)
        assert "\n" not in str(err.value)
    assert spy == []  # refused before transformers saw anything


def test_the_other_entry_points_are_gone():
    """One loader: the aliases and parallel loaders of before issue 27 no longer exist."""
    import retrofit.load as package
    from retrofit.load import models, patched_checkpoint

    assert not hasattr(retrofit, "load_model")
    for name in ("load_model", "load_run", "load_plain_model", "load_checkpoint"):
        assert name not in package.__all__ and not hasattr(package, name), name
    assert not hasattr(patched_checkpoint, "load_model_or_checkpoint") and not hasattr(models, "load_plain_model")


def test_an_adapter_forwards_them_to_its_base(tmp_path, spy):
    """An adapter folder: the base it names is loaded through the same decision, with the same arguments."""
    from retrofit.load import save_adapter
    from tests.load.test_adapters import peft_on_patched

    model, _, ids = peft_on_patched(tmp_path, "llama", "avnorm")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    folder = save_adapter(model, tmp_path / "adapter")
    spy.clear()
    loaded = retrofit.from_pretrained(str(folder), attn_implementation="eager", cache_dir=str(tmp_path / "cache"),
                                      **HUB_ARGS)
    assert [k["attn_implementation"] for name, k in spy if name == "AutoModelForCausalLM"] == ["eager"]
    _forwarded(spy, str(tmp_path / "cache"), revision=None)  # revision names the adapter's; the base's is recorded
    assert loaded.get_base_model().config.retrofit["base_attn_implementation"] == "eager"
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-4)


def test_hub_reachability_is_asked_again_after_its_ttl(monkeypatch):
    now, asked = [100.0], []
    monkeypatch.setattr(sources.hub_reachable, "clock", lambda: now[0])
    monkeypatch.setattr(sources.hub_reachable, "ask", lambda: asked.append(now[0]) or len(asked) % 2 == 1)
    monkeypatch.setattr(sources.hub_reachable, "asked_at", None)  # restored afterwards, with the real answer
    monkeypatch.setattr(sources.hub_reachable, "answer", None)
    ttl = sources.hub_reachable.ttl_s
    assert sources.hub_reachable() is True and asked == [100.0]
    now[0] += ttl / 2
    assert sources.hub_reachable() is True and asked == [100.0]  # within the TTL: the kept answer
    now[0] += ttl
    assert sources.hub_reachable() is False and asked == [100.0, 100.0 + 1.5 * ttl]  # asked again: now offline
