"""The output gate (retrofit.gate, issue 55): a retrofit's gate starts as the ungated patch, bitwise, with every norm
and in every family; the post's form starts at 0.5; with random weights it matches a float64 reference written from
the formula (tests/reference.py); gradients reach it and it trains; it survives PEFT, a reload, unpatch and
torch.compile, and its bad input is refused in one line. The norm contract runs every norm gated too
(tests/norms/test_norm_contract.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import retrofit
from retrofit.errors import RetrofitError
from retrofit.gate import GATE_INPUT, OutputGate, gated, normalize_gate
from retrofit.norms.output_hook import ProjectionHook
from retrofit.patch_spec import PatchSpec
from tests.patch.test_families import twin  # an unpatched twin with its own config
from tests.reference import reference_model
from tests.tiny import COVERAGE, TINY, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NORMS = {
    "softmax": ("softmax", {}),
    "avnorm-rms": ("avnorm", {"kind": "rms"}),
    "avnorm-layer": ("avnorm", {"kind": "layer"}),
    "avnorm-beyond": ("avnorm", {"mode": "beyond", "ref_len": 4, "exponent": 0.3}),
    "psoftmax-p2": ("psoftmax", {"p": 2.0}),
    "ssmax": ("ssmax", {}),
    "softmax1": ("softmax1", {"learnable": True}),
}
REFERENCE_NORMS = [key for key in NORMS if key != "avnorm-beyond"]  # the reference has no mode=beyond
FAMILIES = [f for f in [*TINY, *COVERAGE] if f in CONFIG_MAPPING]


def _randomize(model, seed: int, gate: bool) -> None:
    """The patch's norm parameters (not the gate's) moved the same way in every model; the gate's too when asked."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name and (gate or ".gate." not in name):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("gate", ["head", "element", "head:1:12"])
@pytest.mark.parametrize("norm_key", list(NORMS))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_retrofit_gate_starts_as_the_ungated_patch_bitwise(family, norm_key, gate):
    """start 1 is 2 * sigmoid(0) = 1.0 exactly: logits and their gradients are the ungated patch's, bit for bit."""
    norm, options = NORMS[norm_key]
    ungated, gated_model = tiny_model(family), tiny_model(family)
    retrofit.patch(ungated, norm, **options)
    retrofit.patch(gated_model, norm, gate=gate, **options)
    for model in (ungated, gated_model):
        _randomize(model, seed=5, gate=False)  # the same norm parameters in both; the gate stays at its start
    ids = random_ids(2, 12)
    losses = [model.train()(input_ids=ids, labels=ids).loss for model in (ungated, gated_model)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if ".gate." not in n} for m in (ungated, gated_model)]
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    with torch.no_grad():
        assert torch.equal(ungated.eval()(ids).logits, gated_model.eval()(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_hands_the_gate_its_input(family):
    """Each family's attention forwards the hook's keyword to the attention function: a gated model runs (the
    identity at start, bitwise) and, with random gate weights, equals the float64 reference of its formula."""
    original = tiny_model(family)
    model = twin(original)
    retrofit.patch(model, "avnorm", kind="layer", gate="head")
    ids = random_ids(2, 12)
    with torch.no_grad():
        at_start = model(ids).logits
        retrofit.unpatch(model)
        retrofit.patch(model, "avnorm", kind="layer")
        assert torch.equal(at_start, model(ids).logits)
        retrofit.unpatch(model)
    retrofit.patch(model, "avnorm", kind="layer", gate="element:0.5:12")
    _randomize(model, seed=6, gate=True)
    with torch.no_grad():
        got = model(ids).logits
        want = reference_model(original, model, nope=False)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gate", ["head", "element:0.5:12", "head:2"])
@pytest.mark.parametrize("norm_key", REFERENCE_NORMS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_matches_the_float64_reference(family, norm_key, gate):
    """Random norm and gate weights, a left-padded row: the logits of the formula computed in float64."""
    norm, options = NORMS[norm_key]
    original = tiny_model(family)
    model = twin(original)
    retrofit.patch(model, norm, gate=gate, **options)
    _randomize(model, seed=7, gate=True)
    ids = random_ids(2, 16)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = reference_model(original, model, nope=False)(input_ids=ids, attention_mask=mask).logits
        ungated = original(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    assert (got[valid] - ungated[valid]).abs().max() > 1e-3  # the gate (and norm) changed something


def test_the_posts_gate_starts_at_half():
    """start 0.5, zero weights: every head's output halved, which is the output projection's weight halved (a power
    of two scales exactly)."""
    model, halved = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(model, "softmax", gate="head:0.5:12")
    with torch.no_grad():
        for layer in halved.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5)
        ids = random_ids(2, 12)
        assert torch.equal(model(ids).logits, halved(ids).logits)


def test_gradients_reach_the_gate_and_it_trains():
    """Every layer's gate weight and bias get a gradient at step 0 (start 1: the sigmoid's slope is 0.5, not ~0); then
    training the gates alone lowers the loss on a batch."""
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm", kind="layer", gate="head")
    gates = [m for m in model.modules() if isinstance(m, OutputGate)]
    assert len(gates) == model.config.num_hidden_layers
    ids = random_ids(4, 16)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(g.weight.grad.abs().sum() > 0 and g.bias.grad.abs().sum() > 0 for g in gates)
    params = [p for g in gates for p in g.parameters()]
    optimizer = torch.optim.Adam(params, lr=0.05)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("family, gate", [("gpt2", "element"), ("llama", "head:0.5:12")])
def test_reload_and_unpatch(tmp_path, family, gate):
    """save_pretrained -> retrofit.from_pretrained: the same gate, bitwise; unpatch: the original model bitwise, and
    no hook left behind."""
    original = tiny_model(family)
    model = twin(original)
    retrofit.patch(model, "ssmax", gate=gate)
    _randomize(model, seed=8, gate=True)
    ids = random_ids(2, 12)
    model.save_pretrained(tmp_path / "m")
    again = retrofit.from_pretrained(str(tmp_path / "m"))
    record = retrofit.patch_record(again)
    assert record["gate"] == normalize_gate(gate) and record["format"] == 3
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
        retrofit.unpatch(model)
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert "gate" not in (retrofit.patch_record(tiny_and_patched("softmax")) or {})  # ungated: no gate field


def tiny_and_patched(norm, **options):
    model = tiny_model("llama")
    retrofit.patch(model, norm, **options)
    return model


def test_a_patch_bypassed_teacher_has_no_gate():
    """The distillation teacher (patch bypassed) is the original model, gate and all."""
    original = tiny_model("llama")
    model = twin(original)
    retrofit.patch(model, "avnorm", gate="head:0.5")
    ids = random_ids(2, 12)
    with torch.no_grad(), retrofit.patch_bypassed(model):
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_peft_trains_the_gate_of_its_copy():
    """Under PEFT's modules_to_save the active copy's gate gates the forward (its wrapper hands the copy's
    attribute), and disabling the adapter gives the base's gate back."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama")
    retrofit.patch(base, "avnorm", kind="layer", gate="head")
    ids = random_ids(2, 12)
    with torch.no_grad():
        before = base(ids).logits
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["retrofit"],
                                            task_type="CAUSAL_LM"))
    copies = [p for n, p in model.named_parameters() if "modules_to_save" in n and ".gate." in n]
    assert copies and all(p.requires_grad for p in copies)
    with torch.no_grad():
        for p in copies:
            p.normal_(0.0, 1.0)
        assert not torch.allclose(model(ids).logits, before, atol=1e-4)
        with model.disable_adapter():
            assert torch.equal(model(ids).logits, before)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_compiled_gated_model_equals_eager(backend):
    torch._dynamo.reset()
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm", kind="layer", gate="element:0.5")
    _randomize(model, seed=9, gate=True)
    ids = random_ids(2, 12)
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_gated_avnorm_normalizes_once_and_before_the_gate():
    """Gated, AVNorm acts inside retrofit's attention function (norm, then gate) and not again at the projection."""
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm", kind="rms", gate="head")
    assert model.config._attn_implementation == "retrofit"
    projection = model.model.layers[0].self_attn.o_proj
    assert not any(isinstance(h, ProjectionHook) for h in projection._forward_pre_hooks.values())
    retrofit.unpatch(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("value, message", [
    ("row", "gate kind must be one of head, element, got 'row'"),
    ("head:0", "gate start must be a number > 0"),
    ("head:1:0", "gate inputs must be a whole number of input channels >= 1"),
    ("head:1:2:3", r"write KIND\[:START\[:INPUTS\]\], e.g. head"),
    ({"kind": "head", "strat": 1}, "gate has no key 'strat' .*did you mean 'start'"),
    (3, "gate must be head, element"),
])
def test_bad_gates_are_refused_in_one_line(value, message):
    with pytest.raises(RetrofitError, match=message) as caught:
        PatchSpec("softmax", gate=value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("start", ["1e39", "1e308", "1e-9"])
def test_a_start_outside_its_range_is_refused_before_it_overflows(start):
    """Issue 61: `--gate head:1e39` (or 1e308) was accepted, saved and reloaded, and every logit was NaN: the gate's
    2 * start overflows float32. A start that rounds to nothing (the gate dead, and its gradient) is refused too."""
    with pytest.raises(RetrofitError, match=r"^gate start \S+ is outside 1e-06\.\.1000 .*give a start in that "
                                            r"range$") as caught:
        retrofit.patch(tiny_model("llama"), "softmax", gate=f"head:{start}")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_largest_start_keeps_every_logit_finite(dtype):
    """The range's top (start 1000) in each dtype retrofit loads: every logit finite."""
    model = tiny_model("llama").to(dtype)
    retrofit.patch(model, "avnorm", gate="head:1000")
    with torch.no_grad():
        logits = model(input_ids=random_ids(2, 12)).logits
    assert logits.dtype == dtype and bool(torch.isfinite(logits).all())


def test_gate_rules_need_the_model_or_the_spec():
    with pytest.raises(RetrofitError, match="gate gates every head of the patched layers.*drop heads= or gate"):
        PatchSpec("avnorm", heads="0+1", gate="head")
    with pytest.raises(RetrofitError, match="gate inputs 33 exceeds the attention input's 32 channels"):
        retrofit.patch(tiny_model("llama"), "softmax", gate="head:1:33")
    spec = PatchSpec.parse("avnorm:kind=layer,gate=head:0.5:12")
    assert spec.gate == {"kind": "head", "start": 0.5, "inputs": 12}
    assert PatchSpec.from_record(spec.to_record()) == spec and spec != PatchSpec("avnorm", {"kind": "layer"})


def test_a_gate_without_its_input_or_with_another_length_is_refused():
    """A model whose attention dropped the keyword, or a sharded row (sequence parallelism), fails loudly."""
    model = tiny_model("llama")
    retrofit.patch(model, "softmax", gate="head")
    norm = model.model.layers[0].self_attn.retrofit
    out = torch.randn(1, 6, 4, 8)
    with pytest.raises(RetrofitError, match="carried no input for the gate"):
        gated(norm, out, None)
    with pytest.raises(RetrofitError, match=r"the gate's input has \(1, 3\) tokens but the attention output \(1, 6\)"):
        gated(norm, out, torch.randn(1, 3, 32))
    assert GATE_INPUT.startswith("retrofit_")  # never a name a model's own keyword could carry


def test_old_readers_refuse_a_gated_record_and_read_an_ungated_one():
    """A gated record has format 3 (retrofit before the gate reads <= 2 and refuses it, with 'upgrade'); an ungated
    record carries no gate field at all, so that retrofit still reads it."""
    gated_model, plain = tiny_and_patched("avnorm", gate="head"), tiny_and_patched("avnorm")
    assert retrofit.patch_record(gated_model)["format"] == 3
    assert "gate" not in retrofit.patch_record(plain) and retrofit.patch_record(plain)["format"] == 1


def test_report_names_the_gate():
    report = retrofit.patch(tiny_model("llama"), "avnorm", gate="head:0.5:12")
    assert "gate              head, 0.5 at start (not identity), from input channels 0-11" in str(report)
    assert report.params_added == 2 * (4 + 4 * 12 + 4)  # per layer: AVNorm's 4 gains, the gate's (4, 12) and 4 biases


def test_the_zero_shot_ranking_runs_on_a_gated_patch():
    """retrofit patch --check-text ranks layers and heads by switching the norm's head mask (retrofit.costs): under a
    gate the masked heads keep the original output and the gate (the identity here) still applies after."""
    from retrofit.costs import head_costs, selection_loss

    original = tiny_model("llama")
    model = twin(original)
    retrofit.patch(model, "avnorm", kind="layer", gate="head")
    _randomize(model, seed=10, gate=False)
    ids = random_ids(1, 16)
    with torch.no_grad():
        plain = float(original(input_ids=ids, labels=ids).loss)
        patched = float(model(input_ids=ids, labels=ids).loss)
    assert selection_loss(model, ids, []) == pytest.approx(plain, abs=1e-6)
    assert selection_loss(model, ids, None) == pytest.approx(patched, abs=1e-6) and abs(patched - plain) > 1e-3
    baseline, costs = head_costs(model, ids)
    assert baseline == pytest.approx(plain, abs=1e-6) and len(costs) == model.config.num_attention_heads
