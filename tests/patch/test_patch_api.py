"""retrofit.patch, observe and PatchReport as a user meets them: a norm is required and the error names them all, the
report reads in a notebook, two observed models see only their own calls, and transformers' push_to_hub of a patched
model warns in one line."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch

import retrofit
from retrofit.attention_modules import attention_modules
from retrofit.errors import RetrofitError
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


seam = importlib.import_module("retrofit.attention_seam")  # where observers are held


def test_two_models_observed_at_once_see_only_their_own_calls():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    seen = {"a": [], "b": []}
    ids = random_ids(1, 8)
    with retrofit.observe(a, lambda m, *_: seen["a"].append(m)), retrofit.observe(b, lambda m, *_: seen["b"].append(m)):
        held = [m.__dict__.get(seam.OBSERVER) for _, m in attention_modules(a)]
        assert all(callable(fn) for fn in held)  # the model holds its own observers
        with torch.no_grad():
            a(ids)
        assert len(seen["a"]) == a.config.num_hidden_layers and seen["b"] == []
        with torch.no_grad():
            b(ids)
    a_modules = {id(m) for _, m in attention_modules(a)}
    assert {id(m) for m in seen["a"]} == a_modules and not {id(m) for m in seen["b"]} & a_modules
    assert all(seam.OBSERVER not in m.__dict__ for _, m in attention_modules(a))
    assert not hasattr(seam, "_OBSERVERS")


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
