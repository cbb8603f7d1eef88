"""Bad input to retrofit.patch gets a one-line RetrofitError (the CLI side: tests/cli/test_cli_errors.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import retrofit
from retrofit.errors import RetrofitError
from tests.tiny import tiny_model


@pytest.mark.parametrize("norm,options,match", [
    ("avnrm", {}, "unknown norm 'avnrm' \\(did you mean 'avnorm'\\?\\)"),
    ("psoftmax", {"p": 0.5}, "p must be a finite number >= 1"),
    ("psoftmax", {"p": "two"}, "p must be a number"),
    ("avnorm", {"kind": "batch"}, "kind must be one of rms, layer, global"),
    ("avnorm", {"knd": "rms"}, "no option 'knd' \\(did you mean 'kind'\\?\\)"),
    ("psoftmax", {"kind": "rms"}, "norm 'psoftmax' has no option 'kind'"),
    ("ssmax", {"ref_len": 1}, "ref_len must be an integer >= 2"),
])
def test_bad_norm_or_option(norm, options, match):
    model = tiny_model("llama")
    with pytest.raises(RetrofitError, match=match) as err:
        retrofit.patch(model, norm, **options)
    assert "\n" not in str(err.value)
    assert not retrofit.is_patched(model)  # nothing half-done


def test_double_patch_is_refused():
    model = tiny_model("gpt2")
    retrofit.patch(model, "avnorm")
    with pytest.raises(RetrofitError, match="already patched; call retrofit.unpatch"):
        retrofit.patch(model, "psoftmax")


def test_unpatch_of_unpatched_model_is_refused():
    with pytest.raises(RetrofitError, match="not patched"):
        retrofit.unpatch(tiny_model("gpt2"))


def test_not_a_hf_model():
    with pytest.raises(RetrofitError, match="not a Hugging Face model"):
        retrofit.patch(nn.Linear(2, 2), "avnorm")


def test_gpt2_reorder_and_upcast_under_eager_bypasses_the_registry():
    model = tiny_model("gpt2", attn_implementation="eager", reorder_and_upcast_attn=True)
    with pytest.raises(RetrofitError, match="reorder_and_upcast_attn"):
        retrofit.patch(model, "psoftmax")  # bypassing the registry would bypass its kernels
    retrofit.patch(model, "avnorm")  # the output projection's hook is not bypassed


def test_unsupported_attention_implementation():
    """A kernel norm cannot run over paged attention (avnorm can: tests/norms/test_any_implementation.py)."""
    model = tiny_model("llama")
    model.config._attn_implementation_internal = "paged|sdpa"
    with pytest.raises(RetrofitError, match="cannot run this norm's kernels over paged attention"):
        retrofit.patch(model, "psoftmax")


def test_model_without_registry_attention():
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("gpt_neox", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=64, vocab_size=97)
    model = AutoModelForCausalLM.from_config(cfg)
    # gpt_neox is not in retrofit's table: plain norms work through the generic path, NoPE does not
    with pytest.raises(RetrofitError, match="nope needs to know where 'gpt_neox' adds positions"):
        retrofit.patch(model, "avnorm", nope=True)
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        before = model(ids).logits
        report = retrofit.patch(model, "avnorm")
        after = model(ids).logits
    assert report.family == "generic" and len(report.modules) == 1
    assert not torch.allclose(before, after)  # the norm is really in the path


def test_a_bad_softcap_from_the_model_is_a_one_line_error():
    """Soft-capping is supported by every kernel now (tests/kernels/test_softcap.py); a non-positive cap is refused."""
    model = tiny_model("gemma2", attn_logit_softcapping=-1.0)
    retrofit.patch(model, "psoftmax")
    with pytest.raises(ValueError, match="softcap"):
        model(torch.randint(3, 90, (1, 6)))
