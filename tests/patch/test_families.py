"""Model coverage (issue #16): every family below x every norm x {positions, NoPE}, on tiny models (tests/tiny.py).

Per combination, on one model build each:
  test_causal_cache_padding  a later token leaves earlier logits unchanged; prefill + a chunk + token-by-token decode
                             equals the full forward (past the windows and chunks of 4); a left-padded row equals
                             the row alone (padding of 4, a whole window/chunk)
  test_unpatch_and_reload    save_pretrained -> retrofit.from_pretrained gives equal logits, parameters and record;
                             unpatch gives the original state_dict and logits bitwise
  test_float64_reference     the kernel norms (psoftmax, ssmax, softmax1) against tests/reference.py, every layer type
Then what each family needed: layers that already had no positions, Llama 4's query temperature, gpt_oss's sinks,
the scaling a family sets itself, and the generic pre-checks. A family the installed transformers lacks is skipped
with the reason in its test id.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import retrofit
from retrofit import families
from retrofit.families import position_query_scaling
from retrofit.norms import get_norm, make_options
from retrofit.norms.attention_call import kernel_call
from retrofit.patching import has_sinks
from tests.reference import reference_model
from tests.tiny import COVERAGE, random_ids, tiny_model

FAMILIES = [*COVERAGE, "gemma2"]
# gemma2 with its attention soft-cap on and a window of 4 (tests/tiny.py keeps both off for test_patch.py)
OVERRIDES = {"gemma2": dict(attn_logit_softcapping=1.0, sliding_window=4)}
SINK_FAMILIES = ("gpt_oss",)  # families with learned attention sinks, where a norm may be refused outright
NORMS = retrofit.available_norms()
# The norms retrofit's kernels compute inside attention (neither the baseline nor on the heads' outputs), with their
# example options: each against the float64 reference (tests/reference.py).
KERNEL_NORMS = [n for n in NORMS if not get_norm(n).baseline
                and not get_norm(n).on_output(make_options(n, **get_norm(n).example_options))]


def candidates(norm: str) -> list[dict]:
    """Options to patch `norm` with, in order: its example_options, then with each of its example_variants, each of
    its options at its schema example, and its identity-start value (scheduled_option = schedule_identity)."""
    cls = get_norm(norm)
    base = dict(cls.example_options)
    examples = [o.example_options() for o in cls.option_schema()]
    out = [base, *({**base, **v} for v in cls.example_variants), *({**base, **e} for e in examples if e is not None)]
    if cls.scheduled_option is not None:
        out.append({**base, cls.scheduled_option: cls.schedule_identity})
    return out


def family_options(model, norm: str) -> dict | None:
    """What a family needs `norm` told, read from the norm's hooks: the first candidate that keeps the model's own
    learned sinks (gpt_oss: sink_refusal; softmax1 stack=True, psoftmax p=1) and may stack on queries the model
    already scales by position (Llama 4: stacks_query_scaling; ssmax stack=True). None: no option of the norm can
    (sigmoid keeps no sinks at all); test_gpt_oss_refusals holds that such a patch is refused in one line."""
    cls = get_norm(norm)
    sinks = any(has_sinks(m) for m in model.modules())
    scaling = cls.scales_queries_by_position and position_query_scaling(model.config) is not None
    for options in candidates(norm):
        opts = make_options(norm, **options)
        if not (sinks and cls.sink_refusal(opts)) and not (scaling and not cls.stacks_query_scaling(opts)):
            return options
    return None


def refused_everywhere(family: str, norm: str) -> bool:
    """Whether every option of `norm` is refused on `family` (the families with sinks build a tiny model to ask)."""
    return family in SINK_FAMILIES and family in CONFIG_MAPPING and family_options(build(family), norm) is None


# Llama 4's query temperature counts positions from the first (pad) token, not from position_ids: with the tiny
# floor_scale of 4 a left-padded row differs in the unpatched model too. Its real floor_scale (8192) makes it 1 here.
PADDING_OVERRIDES = {"llama4_text": dict(floor_scale=8192)}


def cases(norms):
    out = []
    for family in FAMILIES:
        for norm in norms:
            for nope in (False, True):
                name = f"{family}-{norm}-{'nope' if nope else 'pos'}"
                if refused_everywhere(family, norm):
                    continue  # a refusal, not a case: test_gpt_oss_refusals
                if family in CONFIG_MAPPING:
                    out.append(pytest.param(family, norm, nope, id=name))
                else:
                    reason = f"transformers {transformers.__version__} has no model type {family!r}"
                    out.append(pytest.param(family, norm, nope, id=f"{name}-SKIPPED-not-in-transformers",
                                            marks=pytest.mark.skip(reason=reason)))
    return out


def build(family, seed=0, **overrides):
    model = tiny_model(family, seed=seed, **{**OVERRIDES.get(family, {}), **overrides})
    with torch.no_grad():  # gpt_oss initializes its sinks near 0: make them matter
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
    return model


def twin(original):
    model = copy.deepcopy(original)
    model.config = copy.deepcopy(original.config)  # twins must not share a config (DESIGN.md)
    for m in model.modules():
        if hasattr(m, "config"):
            m.config = model.config
    return model


def pair(family, norm, nope, **overrides):
    """(original, patched twin) with the twin's norm parameters randomized (to catch head mix-ups)."""
    original = build(family, **overrides)
    model = twin(original)
    retrofit.patch(model, norm, nope=nope, **family_options(original, norm))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return original, model


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("family,norm,nope", cases(NORMS))
def test_causal_cache_padding(one_thread, family, norm, nope):
    _, model = pair(family, norm, nope)
    ids = random_ids(1, 12)
    changed = ids.clone()
    changed[0, 8:] = (ids[0, 8:] + 5) % 90 + 3
    with torch.no_grad():
        full, other = model(ids).logits, model(changed).logits
    close(full[0, :8], other[0, :8], 1e-6)  # causal
    assert (full[0, 8:] - other[0, 8:]).abs().max() > 1e-4

    with torch.no_grad():  # prefill 5, a chunk of 3 onto the cache, then one token at a time
        out = model(ids[:, :5], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t0, t1 in [(5, 8), (8, 9), (9, 10), (10, 11), (11, 12)]:
            out = model(ids[:, t0:t1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    close(torch.cat(steps, 1), full)

    if family in PADDING_OVERRIDES:
        _, model = pair(family, norm, nope, **PADDING_OVERRIDES[family])
    long, short = random_ids(1, 12, seed=3)[0], random_ids(1, 8, seed=4)[0]
    batch, mask = torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 4:], mask[1, 4:] = short, 1
    with torch.no_grad():
        together = model(input_ids=batch, attention_mask=mask).logits
        close(together[0], model(long[None]).logits[0])
        close(together[1, 4:], model(short[None]).logits[0])


@pytest.mark.parametrize("family,norm,nope", cases(NORMS))
def test_unpatch_and_reload(one_thread, tmp_path, family, norm, nope):
    original, model = pair(family, norm, nope)
    ids = random_ids(2, 10)
    with torch.no_grad():
        patched = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = retrofit.from_pretrained(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, patched)
    added = {n: p for n, p in model.named_parameters() if ".retrofit." in n}
    reloaded = {n: p for n, p in loaded.named_parameters() if ".retrofit." in n}
    assert added.keys() == reloaded.keys() and all(torch.equal(added[n], reloaded[n]) for n in added)
    assert loaded.config.retrofit == model.config.retrofit

    retrofit.unpatch(model)
    want, got = original.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert model.config._attn_implementation == original.config._attn_implementation


@pytest.mark.parametrize("family,norm,nope", cases(KERNEL_NORMS))
def test_float64_reference(one_thread, family, norm, nope):
    original, model = pair(family, norm, nope)
    ids = random_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = reference_model(original, model, nope)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    close(got[valid], want[valid])


# ---------------------------------------------------------------- what each family needed

def needs(family):
    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no model type {family!r}")


@pytest.mark.parametrize("family,layers", [("smollm3", [1]), ("cohere2", [1]), ("llama4_text", [1])])
def test_report_says_which_layers_already_had_no_positions(family, layers):
    needs(family)
    from retrofit.families import layers_without_positions
    assert layers_without_positions(build(family).config) == layers
    kept = retrofit.patch(build(family), "avnorm")
    assert f"layer {layers[0]} already had no positions" in kept.notes
    removed = retrofit.patch(build(family), "avnorm", nope=True)
    assert removed.positions.endswith(f"layer {layers[0]} already had no positions")
    assert "already had no positions" in str(removed)


def test_llama4_ssmax_refused_unless_stacked():
    needs("llama4_text")
    with pytest.raises(retrofit.RetrofitError, match="attention temperature.*stack=True") as err:
        retrofit.patch(build("llama4_text"), "ssmax")
    assert "\n" not in str(err.value)
    report = retrofit.patch(build("llama4_text"), "ssmax", stack=True)
    assert any("stacked on the model's own Llama 4's attention temperature" in n for n in report.notes)
    # no temperature tuning, nothing to stack on
    assert retrofit.patch(build("llama4_text", attn_temperature_tuning=False), "ssmax").notes == [
        "layer 1 already had no positions"]


def test_gpt_oss_refusals():
    """Every norm whose example options cannot keep gpt_oss's learned sinks (its sink_refusal) is refused in one line
    giving that reason, and the model is left unpatched."""
    needs("gpt_oss")
    refused = []
    for norm in NORMS:
        options = get_norm(norm).example_options
        reason = get_norm(norm).sink_refusal(make_options(norm, **options))
        if reason is None:
            continue
        model = build("gpt_oss")
        with pytest.raises(retrofit.RetrofitError, match=f"^gpt_oss has learned attention sinks: {re.escape(reason)}$"):
            retrofit.patch(model, norm, **options)
        assert not retrofit.is_patched(model)
        refused.append(norm)
    assert {"psoftmax", "softmax1"} <= set(refused)  # what the hand-written list held (issue 63): a floor


@pytest.mark.parametrize("norm", [n for n in NORMS if not get_norm(n).baseline
                                  and not refused_everywhere("gpt_oss", n)])
def test_gpt_oss_sinks_are_used_and_learn(one_thread, norm):
    """The model's sinks reach every norm's output, patched with what family_options picks (the example options where
    the norm keeps sinks): their gradient is non-zero (a dropped sink would get none)."""
    needs("gpt_oss")
    model = build("gpt_oss")
    report = retrofit.patch(model, norm, **family_options(model, norm))
    assert any("learned attention sinks are" in n for n in report.notes)
    model.train()
    ids = random_ids(2, 10)
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in model.model.layers:
        assert layer.self_attn.sinks.grad is not None and layer.self_attn.sinks.grad.abs().sum() > 0


def test_gpt_oss_softmax_keeps_the_model_bitwise():
    needs("gpt_oss")
    original, model = build("gpt_oss"), build("gpt_oss")
    retrofit.patch(model, "softmax")
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_a_kernel_never_drops_sinks_silently():
    module = torch.nn.Module()
    q = k = v = torch.zeros(1, 2, 3, 4)
    with pytest.raises(retrofit.RetrofitError, match="would drop"):
        kernel_call(lambda *a, **kw: q, module, q, k, v, None, s_aux=torch.zeros(2))


@pytest.mark.parametrize("family,scaling", [("granite", 0.5), ("gemma3_text", 16 ** -0.5)])
def test_a_family_scaling_is_kept(family, scaling):
    """Granite's attention_multiplier and Gemma 3's query_pre_attn_scalar reach the norm as the logit scale."""
    needs(family)
    model = build(family)
    retrofit.patch(model, "psoftmax")
    seen = []
    with retrofit.observe(model, lambda m, q, k, v, mask, s, norm: seen.append(s)), torch.no_grad():
        model(random_ids(1, 6))
    assert seen == [scaling] * model.config.num_hidden_layers


# ---------------------------------------------------------------- generic pre-checks

@pytest.mark.parametrize("impl,what", [("paged|sdpa", "paged attention"),
                                       ("kernels-community/flash-attn", "a Hub kernel")])
def test_implementations_kernel_norms_cannot_run_over_are_refused(impl, what):
    """(flash and flex run retrofit's kernels instead while patched; avnorm works over all of these:
    tests/norms/test_any_implementation.py)"""
    model = build("llama")
    model.config._attn_implementation = impl
    with pytest.raises(retrofit.RetrofitError, match="attn_implementation='sdpa'") as err:
        retrofit.patch(model, "psoftmax")
    assert what in str(err.value) and "\n" not in str(err.value)


def test_transformers_own_backend_check_runs_first():
    needs("gpt_oss")
    model = build("gpt_oss")
    model.config._attn_implementation = "sdpa"  # gpt_oss has no sdpa path: its sinks live in its eager function
    with pytest.raises(retrofit.RetrofitError, match="does not support attention implementation 'sdpa'.*'eager'"):
        retrofit.patch(model, "ssmax")  # a kernel norm wraps the implementation (avnorm leaves it alone)


@pytest.mark.parametrize("family,base", [("llama", "sdpa"), ("gemma2", "eager")])
def test_a_model_built_from_a_patched_models_config(family, base):
    patched = build(family)
    retrofit.patch(patched, "ssmax")
    fresh = AutoModelForCausalLM.from_config(patched.config).eval()  # built with our implementation's name
    assert fresh.config._attn_implementation in ("retrofit", "retrofit_eager") and not retrofit.is_patched(fresh)
    ids = random_ids()
    with torch.no_grad():
        before = patched(ids).logits
    report = retrofit.patch(fresh, "psoftmax")
    assert report.base_attn_implementation == base and any("config copied" in n for n in report.notes)
    retrofit.unpatch(fresh)
    assert fresh.config._attn_implementation == base
    # the patched model kept its record and its implementation, so its outputs
    assert patched.config.retrofit["norm"] == "ssmax" and patched.config._attn_implementation != base
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, before)


# ---------------------------------------------------------------- model knowledge lives in the table

def test_a_family_flag_that_bypasses_the_registry_under_eager_is_refused(monkeypatch):
    """Family.eager_bypass names a config flag under which the family's attention computes attention itself under
    eager (GPT-2's reorder_and_upcast_attn): patch() refuses that model under eager, naming the flag and the two ways
    out, and patches it under sdpa or with the flag off. The check reads the row, so any family's row can say so."""
    monkeypatch.setitem(families.FAMILIES, "llama",
                        dataclasses.replace(families.FAMILIES["llama"], eager_bypass="own_attention"))
    with pytest.raises(retrofit.RetrofitError) as err:
        retrofit.patch(tiny_model("llama", attn_implementation="eager", own_attention=True), "ssmax")
    assert str(err.value) == ("llama with own_attention=True under eager bypasses the attention registry; load it "
                              "with attn_implementation='sdpa' or set own_attention=False")
    assert retrofit.patch(tiny_model("llama", attn_implementation="sdpa", own_attention=True), "ssmax").modules
    assert retrofit.patch(tiny_model("llama", attn_implementation="eager", own_attention=False), "ssmax").modules


def test_patching_and_the_vllm_plan_name_no_family():
    """What a family needs (a refusal, what vLLM serves or guards) is a Family field read by patching.py and
    serve/plan.py, never a model_type or architecture string tested there."""
    import ast
    from pathlib import Path

    rows = families.FAMILIES
    names = set(rows) | {f.vllm.architecture for f in rows.values() if f.vllm is not None}
    root = Path(retrofit.__file__).parent
    for path in (root / "patching.py", root / "serve" / "plan.py"):
        named = [f"{path.name}:{node.lineno} {node.value!r}" for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and (node.value in names or node.value.endswith(("ForCausalLM", "LMHeadModel")))]
        assert named == []


@pytest.mark.parametrize("family", sorted(m for m, f in families.FAMILIES.items() if f.vllm is not None))
def test_a_familys_vllm_architecture_is_transformers_causal_lm_class(family):
    """Family.vllm.architecture is what config.json names (transformers' CausalLM class for the model type): the
    name vLLM looks the model up by, so a wrong one would leave the family unguarded."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    needs(family)
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family] == families.FAMILIES[family].vllm.architecture
