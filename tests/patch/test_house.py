"""Issue 27 (house round 2): one logit head, no module-level state changed per call, config.retrofit written by one
module, transformers' habits (norm required, PatchReport's reprs, push_to_hub warns), p-softmax's gain kept."""

from __future__ import annotations

import ast
import copy
import importlib
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import retrofit
from retrofit.errors import RetrofitError
from retrofit.evaluate import losses
from retrofit.kernels import masks
from retrofit.load import sources
from retrofit.record import FIELDS, read_record, write_record
from retrofit.recovery.distill import chunked_kl_sum
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ROOT = Path(retrofit.__file__).parent
patch_module = importlib.import_module("retrofit.patch")  # the module (retrofit.patch is the function)


# ---- item 2: one logit head -------------------------------------------------------------------------------------

def _softcap_only_in_text_config():
    """A Gemma-style config: the soft-cap lives in a nested text_config, none at the top."""
    model = tiny_model("llama")
    assert getattr(model.config, "final_logit_softcapping", None) is None
    model.config.text_config = types.SimpleNamespace(final_logit_softcapping=0.5)
    return model


def test_a_softcap_in_text_config_caps_evaluation_and_distillation():
    model = _softcap_only_in_text_config()
    ids = random_ids(2, 10)
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids, use_cache=False)[0]  # (B, T, d)
        raw = model.get_output_embeddings()(hidden).float()  # (B, T, V)
    capped = torch.tanh(raw / 0.5) * 0.5
    assert not torch.allclose(raw, capped)  # the cap changes these logits
    torch.testing.assert_close(losses.head_logits(model, hidden), capped)  # evaluation
    labels = ids.roll(-1, 1)
    expected = F.cross_entropy(capped.flatten(0, 1), labels.flatten(), reduction="sum")
    with torch.no_grad():  # distillation: the lm term of the chunked head, over 3-token chunks
        got = chunked_kl_sum(model, hidden, None, labels, lm_weight=1.0, kl_weight=0.0, chunk_tokens=6)
    torch.testing.assert_close(got, expected)


def test_evaluation_and_distillation_share_one_head():
    from retrofit.recovery import distill
    assert losses.head_logits is retrofit.logit_head.head_logits is distill.head_logits
    assert not hasattr(distill, "LOGIT_TRANSFORMS")


# ---- item 3: no module-level state changed per call -------------------------------------------------------------

def test_two_models_observed_at_once_see_only_their_own_calls():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    seen = {"a": [], "b": []}
    ids = random_ids(1, 8)
    with retrofit.observe(a, lambda m, *_: seen["a"].append(m)), retrofit.observe(b, lambda m, *_: seen["b"].append(m)):
        held = [m.__dict__.get(patch_module.OBSERVER) for _, m in patch_module.attention_modules(a)]
        assert all(callable(fn) for fn in held)  # the model holds its own observers
        with torch.no_grad():
            a(ids)
        assert len(seen["a"]) == a.config.num_hidden_layers and seen["b"] == []
        with torch.no_grad():
            b(ids)
    a_modules = {id(m) for _, m in patch_module.attention_modules(a)}
    assert {id(m) for m in seen["a"]} == a_modules and not {id(m) for m in seen["b"]} & a_modules
    assert all(patch_module.OBSERVER not in m.__dict__ for _, m in patch_module.attention_modules(a))
    assert not hasattr(patch_module, "_OBSERVERS")


def test_hides_future_keeps_its_answers_on_the_mask_not_in_the_module():
    mutable = {name for name, value in vars(masks).items()
               if isinstance(value, (list, dict, set)) and not name.startswith("__")}
    assert mutable == set()
    mask, other = masks.causal_mask(8, 8)[None, None].clone(), masks.causal_mask(8, 8)[None, None].clone()
    assert masks.hides_future(mask, 8, 8)
    assert getattr(mask, masks.KEPT_ANSWERS) == {(8, 8): (mask._version, True)}
    assert not hasattr(other, masks.KEPT_ANSWERS)  # another mask holds nothing of this one's
    mask[..., 0, 5] = True  # the same object, changed in place: asked afresh
    assert not masks.hides_future(mask, 8, 8)


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


# ---- item 5: config.retrofit owned by retrofit/record.py --------------------------------------------------------

def _retrofit_stores(tree) -> list[int]:
    """Lines that assign or delete `<x>.retrofit` or `<x>.retrofit[...]`."""
    lines = []
    for node in ast.walk(tree):
        target = node.value if isinstance(node, ast.Subscript) else node
        if (isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del))
                and isinstance(target, ast.Attribute) and target.attr == "retrofit"):
            lines.append(node.lineno)
    return lines


def test_only_the_record_module_assigns_config_retrofit():
    writers = {}
    for path in ROOT.rglob("*.py"):
        lines = _retrofit_stores(ast.parse(path.read_text()))
        if lines and path.name != "record.py":
            writers[str(path.relative_to(ROOT.parent))] = lines
    assert writers == {}
    assert _retrofit_stores(ast.parse("m.config.retrofit = {}\nc.retrofit['norm'] = 'x'\n")) == [1, 2]  # not vacuous


def test_write_record_fills_the_schema_and_refuses_unknown_fields():
    model = tiny_model("llama")
    record = write_record(model, norm="ssmax")
    assert set(record) == set(FIELDS) and record["format"] == FIELDS["format"] and read_record(model) is record
    with pytest.raises(RetrofitError, match="no field calibraton"):
        write_record(model, calibraton={})


# ---- item 6: transformers' habits ---------------------------------------------------------------------------------

def test_patch_requires_a_norm_and_names_them():
    with pytest.raises(RetrofitError) as err:
        retrofit.patch(tiny_model("llama"))
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in retrofit.available_norms())


def test_patch_report_reads_in_a_notebook():
    report = retrofit.patch(tiny_model("llama"), "ssmax")
    assert repr(report).startswith("<PatchReport ssmax on llama: 2 attention modules over sdpa")
    assert "options=" not in repr(report) and "\n" not in repr(report)
    markdown = report._repr_markdown_().splitlines()
    assert markdown[:2] == ["| retrofit patch | |", "|---|---|"] and len(markdown) == 2 + len(str(report).splitlines())
    assert "| norm | ssmax (" in report._repr_markdown_()


def test_transformers_push_to_hub_of_a_patched_model_warns_in_one_line(monkeypatch):
    pushed = []
    model, other = tiny_model("llama"), tiny_model("llama")
    monkeypatch.setattr(type(model), "push_to_hub", lambda self, repo, **kw: pushed.append((self, repo)) or "url")
    retrofit.patch(model, "avnorm")
    with pytest.warns(UserWarning, match=r"patched by retrofit.*retrofit push") as caught:
        assert model.push_to_hub("me/x") == "url"
    assert "\n" not in str(caught[0].message) and pushed == [(model, "me/x")]
    twin = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="retrofit push"):
        twin.push_to_hub("me/y")
    assert pushed[-1] == (twin, "me/y")  # the copy pushes itself
    retrofit.unpatch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unpatched model (another instance of the class) pushes silently
        other.push_to_hub("me/z")
        model.push_to_hub("me/w")
    assert "push_to_hub" not in vars(model) and [repo for _, repo in pushed[-2:]] == ["me/z", "me/w"]


# ---- stale: p-softmax's gain is a parameter -----------------------------------------------------------------------

def test_psoftmax_has_parameters_exactly_when_it_has_a_gain():
    with_gain, without = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(with_gain, "psoftmax", gain=1.0)
    retrofit.patch(without, "psoftmax")
    norms = [m for m in with_gain.modules() if isinstance(m, retrofit.norms.Norm)]
    assert norms and all(n.has_parameters for n in norms)
    assert not any(n.has_parameters for n in without.modules() if isinstance(n, retrofit.norms.Norm))


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


# ---- stale: calibrate's names say what they are -------------------------------------------------------------------

def test_old_calibrate_recipe_keys_read_as_calibrate_tokens(tmp_path):
    from retrofit.recipe import recipe_from_dict
    (tmp_path / "t.txt").write_text("some text\n")
    base = {"model": {"source": "gpt2"}, "data": {"files": [str(tmp_path / "t.txt")]}}  # nothing is loaded
    old = recipe_from_dict({**base, "patch": {"norm": "avnorm", "calibrate": 64}, "recovery": {"calibrate": 32}})
    new = recipe_from_dict({**base, "patch": {"norm": "avnorm", "calibrate_tokens": 64},
                            "recovery": {"calibrate_tokens": 32}})
    assert old.patch.calibrate_tokens == new.patch.calibrate_tokens == 64 and "calibrate" not in old.patch.options
    assert old.section("recovery").calibrate_tokens == new.section("recovery").calibrate_tokens == 32
