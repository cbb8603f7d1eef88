"""retrofit.recovery, the pieces: identity-start schedules (start = the original model, end = the plain norm,
bitwise), the bypassed teacher, chunked KL, attention-output matching, the patch's parameter group, the probes,
bad input. Training with them (resume, reload, convergence) is tests/recovery/test_recovery_train.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import retrofit
from retrofit.calibration import calibrate
from retrofit.errors import RetrofitError
from retrofit.load import load
from retrofit.recipe import RecoverySection, TrainSection, recipe_from_dict
from retrofit.recovery import (
    attention_outputs,
    head_spread,
    is_patch_parameter,
    kl_and_ce_sum,
    match_sum,
    patch_bypassed,
    record_schedule,
    schedule_losses,
    set_schedule_position,
)
from retrofit.recovery.distill import kl_per_position
from retrofit.recovery.schedule import position_at, scheduled_value_at
from retrofit.train import optimizer_setup, run_checks, schedules, train
from tests.tiny import random_ids, tiny_model
from tests.train.test_checkpoints import counting_recipe

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# (norm, options, start for the identity end): each with a non-default end so "end" is not just "untouched".
ARMS = [
    ("avnorm", {"floor": 0.0}, 1e4),
    ("avnorm", {"floor": 0.5, "affine": True}, 1e4),
    ("psoftmax", {"p": 2.0}, None),
    ("psoftmax", {"p": 3.0, "gain": 1.0}, None),
    ("softmax1", {"sink": 0.0}, None),
    ("ssmax", {}, None),
    ("ssmax", {"scale": "beyond", "ref_len": 4}, None),
]
IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for n, o, _ in ARMS]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _calibrated(model, norm):
    if norm in ("avnorm", "psoftmax"):
        try:
            calibrate(model, [random_ids(2, 24, seed=3)])
        except RetrofitError:  # psoftmax without a gain: nothing to calibrate
            pass
    return model


@pytest.mark.parametrize("norm, options, start", ARMS, ids=IDS)
def test_schedule_end_is_the_plain_norm_bitwise_and_start_is_the_original(norm, options, start):
    ids = random_ids(2, 24)
    original = _logits(tiny_model("llama"), ids)
    plain = tiny_model("llama")
    retrofit.patch(plain, norm, **options)
    scheduled = tiny_model("llama")
    retrofit.patch(scheduled, norm, **options)
    _calibrated(plain, norm)
    _calibrated(scheduled, norm)
    set_schedule_position(scheduled, 0.0, start=start)
    at_start = _logits(scheduled, ids)
    set_schedule_position(scheduled, 0.9, start=start)
    midway = _logits(scheduled, ids)
    set_schedule_position(scheduled, 1.0, start=start)
    assert torch.equal(_logits(scheduled, ids), _logits(plain, ids))  # the end: the plain patch, bitwise
    assert (at_start - original).abs().max() <= 1e-6                    # the start: the original model
    assert not torch.equal(midway, at_start) and not torch.equal(midway, _logits(plain, ids))


def test_learned_sink_started_very_negative_is_the_original_model():
    ids = random_ids(2, 24)
    model = tiny_model("llama")
    original = _logits(model, ids)
    retrofit.patch(model, "softmax1", learnable=True, sink=-30.0)
    assert (_logits(model, ids) - original).abs().max() <= 1e-6
    with pytest.raises(RetrofitError, match="learns its sink"):
        set_schedule_position(model, 0.0)


def test_schedule_shapes_and_layer_by_layer():
    assert scheduled_value_at(0.0, 8.0, 0.0) == 8.0 and scheduled_value_at(0.5, 8.0, 0.0) == 4.0
    assert scheduled_value_at(1.0, 8.0, 0.3) == 0.3
    assert scheduled_value_at(0.25, 8.0, 0.0, "cosine") == pytest.approx(8.0 - 8.0 * (1 - 2 ** -0.5) / 2)
    # two layers: the first moves over [0, 0.5], the second over [0.5, 1]
    assert [scheduled_value_at(0.25, 1.0, 2.0, layer=i, layers=2, by_layer=True) for i in range(2)] == [1.5, 1.0]
    assert [scheduled_value_at(0.75, 1.0, 2.0, layer=i, layers=2, by_layer=True) for i in range(2)] == [2.0, 1.5]
    assert position_at(0, 4) == 0.0 and position_at(2, 4) == 0.5 and position_at(9, 4) == 1.0
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    assert set_schedule_position(model, 0.25, by_layer=True) == [1.5, 1.0]


def test_psoftmax_gain_is_calibrated_to_the_original_scale():
    ids = random_ids(2, 24)
    model = tiny_model("llama")
    original = _logits(model, ids)
    retrofit.patch(model, "psoftmax", p=2.0, gain=1.0)
    uncalibrated = (_logits(model, ids) - original).abs().mean()
    summary = calibrate(model, [ids])
    assert summary["gain_max"] < 1.0  # p-softmax outputs are larger than softmax's: gains shrink them
    assert (_logits(model, ids) - original).abs().mean() < 0.5 * uncalibrated
    assert model.config.retrofit["calibration"]["tokens"] == ids.numel()


# ---- the teacher and the losses -------------------------------------------------------------------------------------

def test_the_bypassed_teacher_is_the_unpatched_model_bitwise_and_the_patch_comes_back():
    ids = random_ids(2, 24)
    model = tiny_model("llama")
    original = _logits(model, ids)
    retrofit.patch(model, "avnorm")
    patched = _logits(model, ids)
    names = [n for n, _ in model.named_parameters()]
    with patch_bypassed(model):
        assert torch.equal(_logits(model, ids), original)
    assert torch.equal(_logits(model, ids), patched)
    assert [n for n, _ in model.named_parameters()] == names  # same parameters, same order (the optimizer's)
    with pytest.raises(RetrofitError, match="a teacher needs a patched model"):
        with patch_bypassed(tiny_model("llama")):
            pass


@pytest.mark.parametrize("rope", ["yarn:4", "dynamic:4"])
def test_the_teacher_of_a_rope_extended_student_is_the_original_model_and_the_extension_comes_back(rope):
    ids = random_ids(2, 24)
    model = tiny_model("llama")
    original = _logits(model, ids)
    config = model.config
    saved = (config.max_position_embeddings, dict(config.rope_parameters))
    retrofit.patch(model, "softmax", rope=rope)
    softmax_extended = _logits(model, ids)  # at 24 positions: yarn differs (scaled frequencies), dynamic is the same
    retrofit.unpatch(model)
    retrofit.patch(model, "avnorm", rope=rope)
    extended = (config.max_position_embeddings, dict(config.rope_parameters))
    rotary = model.model.rotary_emb
    patched = _logits(model, ids)
    with patch_bypassed(model):
        assert torch.equal(_logits(model, ids), original)
        assert (config.max_position_embeddings, dict(config.rope_parameters)) == saved
    assert model.model.rotary_emb is rotary
    assert (config.max_position_embeddings, dict(config.rope_parameters)) == extended
    assert torch.equal(_logits(model, ids), patched)
    assert torch.equal(softmax_extended, original) == rope.startswith("dynamic")


def test_a_nope_student_has_no_teacher():
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm", nope=True)
    with pytest.raises(RetrofitError, match="drop nope or the KL"):
        with patch_bypassed(model):
            pass


def _full_kl(model, ids, labels, temperature=1.0):
    student = model(input_ids=ids, use_cache=False).logits.float()
    with patch_bypassed(model), torch.no_grad():
        teacher = model(input_ids=ids, use_cache=False).logits.float()
    t, s = torch.log_softmax(teacher / temperature, -1), torch.log_softmax(student / temperature, -1)
    valid = labels != -100
    return temperature ** 2 * ((t.exp() * (t - s)).sum(-1) * valid).sum()


def test_chunked_kl_equals_the_full_logit_kl_with_its_gradient():
    ids = random_ids(2, 24)
    batch = {"input_ids": ids, "labels": ids.clone()}
    batch["labels"][0, 5:9] = -100
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    model = tiny_model("llama").train()
    retrofit.patch(model, "avnorm")
    gain = model.model.layers[0].self_attn.retrofit.gain
    full = _full_kl(model, ids, labels, temperature=2.0)
    (g_full,) = torch.autograd.grad(full, gain)
    chunked = kl_and_ce_sum(model, batch, lm_weight=0.0, kl_weight=1.0, temperature=2.0, chunk_tokens=7)
    (g_chunked,) = torch.autograd.grad(chunked, gain)
    chunked, full = float(chunked.detach()), float(full.detach())
    assert abs(chunked - full) <= 1e-5 * max(1.0, full) and full > 1e-3
    assert torch.allclose(g_chunked, g_full, rtol=1e-4, atol=1e-6)
    ce = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                         reduction="sum")
    mixed = kl_and_ce_sum(model, batch, lm_weight=0.5, kl_weight=2.0, temperature=2.0, chunk_tokens=5)
    assert abs(float(mixed.detach()) - float(0.5 * ce.detach() + 2.0 * full)) <= 1e-4


@pytest.mark.parametrize("norm, options", [("softmax", {}), ("avnorm", {"floor": float("inf")})])
def test_the_kl_and_the_output_match_of_an_unchanged_model_are_zero(norm, options):
    ids = random_ids(2, 24)
    model = tiny_model("llama")
    retrofit.patch(model, norm, **options)
    batch = {"input_ids": ids, "labels": ids}
    assert float(kl_and_ce_sum(model, batch, lm_weight=0.0, kl_weight=1.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(match_sum(model, batch)) == pytest.approx(0.0, abs=1e-10)
    with attention_outputs(model) as outs:
        model(input_ids=ids)
    assert len(outs) == 2 and outs[0].shape == (2, 24, 32)  # (B, T, H * D) per layer


def test_match_loss_trains_the_patch_toward_the_teacher():
    ids = random_ids(2, 24)
    model = tiny_model("llama").train()
    retrofit.patch(model, "avnorm")  # unit gains: far from the original scale
    batch = {"input_ids": ids, "labels": ids}
    gains = [p for n, p in model.named_parameters() if is_patch_parameter(n)]
    opt = torch.optim.Adam(gains, lr=0.05)
    first = float(match_sum(model, batch))
    for _ in range(20):
        opt.zero_grad()
        match_sum(model, batch).backward()
        opt.step()
    assert float(match_sum(model, batch)) < 0.5 * first


# ---- parameter groups, probes, recipes, bad input ------------------------------------------------------------------

def test_the_optimizer_holds_the_recipes_rates():
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    train = TrainSection(lr=1e-4, warmup_steps=10, steps=100)
    rec = RecoverySection(patch_lr=3e-2, patch_warmup_steps=2)
    opt = optimizer_setup.make_optimizer(model, train, rec)
    names = {g["name"]: g for g in opt.param_groups}
    assert set(names) == {"decay", "no_decay", "patch"}
    assert len(names["patch"]["params"]) == 2 and names["patch"]["weight_decay"] == 0.0  # 2 layers' gains
    rates = schedules.group_lrs(5, train, rec)
    assert rates["decay"] == pytest.approx(1e-4 * 6 / 10)  # warming up over 10 steps
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 98))  # patch: warm after 2, 3 of 98 steps into the decay
    assert rates["patch"] == pytest.approx(3e-2 * cosine)
    assert schedules.group_lrs(0, train, rec)["patch"] == pytest.approx(3e-2 / 2)
    optimizer_setup.freeze_base(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.self_attn.retrofit.gain" for i in range(2)}


def test_probes_loss_along_the_schedule_and_head_spread():
    ids = random_ids(1, 32)
    model = tiny_model("llama")
    original = float(model(input_ids=ids, labels=ids).loss)
    retrofit.patch(model, "avnorm")
    rows = schedule_losses(model, ids, [0.0, 0.5, 1.0], start=1e5)
    assert [r[:2] for r in rows] == [(0.0, 1e5), (0.5, 5e4), (1.0, 0.0)]
    assert rows[0][2] == pytest.approx(original, abs=1e-5)
    assert model.model.layers[0].self_attn.retrofit.floor == 0.0  # left at the end
    spread = head_spread(model, ids)
    assert spread.shape == (2, 4) and bool(((spread >= 0) & (spread < 1)).all())
    # by hand for layer 0: the original model's head outputs
    from retrofit import observe
    captured = []
    with patch_bypassed(model), observe(model, lambda m, q, k, v, *a: captured.append((q, k, v))):
        model(input_ids=ids)
    q, k, v = captured[0]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (1, H, T, D)
    rms = out.pow(2).mean(-1).sqrt()[0]  # (H, T)
    assert torch.allclose(spread[0], 1 - rms.mean(-1) ** 2 / rms.pow(2).mean(-1), atol=1e-5)


def _recipe(recovery: dict, patch=None):
    return recipe_from_dict({"model": {"config": {"model_type": "llama", "hidden_size": 32}},
                             "patch": patch or {"norm": "avnorm"}, "data": {"task": "counting"},
                             "recovery": recovery})


@pytest.mark.parametrize("recovery, message", [
    ({"kl_weight": -1.0}, r"recovery.kl_weight must be >= 0, got -1.0"),
    ({"lm_weight": -0.5}, r"recovery.lm_weight must be >= 0"),
    ({"lm_weight": 0.0}, r"both 0: nothing to train"),
    ({"schedule": {"steps": 0}}, r"recovery.schedule.steps must be >= 1"),
    ({"schedule": {"steps": 5, "shape": "cubic"}}, r"recovery.schedule.shape must be one of linear, cosine"),
    ({"kl_wieght": 1.0}, r"unknown recipe key recovery.kl_wieght \(did you mean 'kl_weight'\?\)"),
])
def test_bad_recovery_sections_are_one_line_errors(recovery, message):
    with pytest.raises(RetrofitError, match=message) as err:
        _recipe(recovery)
    assert "\n" not in str(err.value)


def test_a_schedule_on_a_norm_without_a_knob_and_a_teacher_on_no_patch_are_one_line_errors():
    model = tiny_model("llama")
    retrofit.patch(model, "softmax")
    with pytest.raises(RetrofitError, match=r"norm 'softmax' has no knob a schedule can move; norms with one: "
                                            r"avnorm \(floor\), psoftmax \(p\)"):
        set_schedule_position(model, 0.0)
    recipe = _recipe({"schedule": {"steps": 5}}, patch={"norm": "softmax"})
    with pytest.raises(RetrofitError, match="has no knob"):
        run_checks.check_recovery(model, dataclasses.replace(recipe, train=TrainSection(steps=10)))
    recipe = _recipe({"kl_weight": 1.0}, patch={"norm": None})
    with pytest.raises(RetrofitError, match="the recovery section needs a patch"):
        run_checks.check_recovery(tiny_model("llama"), recipe)
    with pytest.raises(RetrofitError, match="avnorm floor applies to kind=rms only"):
        retrofit.patch(tiny_model("llama"), "avnorm", kind="layer", floor=1.0)


IDS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))


def _psoftmax_model(p: float, gain: float):
    model = tiny_model("llama").eval()
    retrofit.patch(model, "psoftmax", p=p, gain=gain)
    with torch.no_grad():  # per-head gains apart, as calibration and training leave them
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.retrofit.gain.copy_(torch.tensor([0.3, 0.6, 1.7, 2.9]) * (i + 1))
    return model


@pytest.mark.parametrize("end", [1.5, 3.0, 1.0])
def test_a_psoftmax_gain_schedule_ending_elsewhere_reloads_to_the_trained_model(end, tmp_path):
    """The knob at the schedule's end `end` != the patch's p=2: the trained forward uses g^((end-1)/(p-1)). Before,
    config.retrofit recorded p=end and a reload applied the full g (logits off by ~0.07); now it is bitwise."""
    model = _psoftmax_model(2.0, 1.0)
    set_schedule_position(model, 1.0, end=end)
    with torch.no_grad():
        trained = model(input_ids=IDS).logits
    record_schedule(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, trained)  # settling changes nothing in memory
    assert model.config.retrofit["options"]["p"] == end
    model.save_pretrained(tmp_path / "m")
    reloaded = retrofit.from_pretrained(str(tmp_path / "m")).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, trained)


def test_a_trained_psoftmax_gain_schedule_reloads_bitwise(tmp_path):
    raw = counting_recipe(tmp_path / "run", steps=4, save_every=0)
    raw["patch"] = {"norm": "psoftmax", "p": 2.0, "gain": 0.8}
    raw["recovery"] = {"schedule": {"steps": 2, "end": 1.5}}
    result = train(recipe_from_dict(raw))
    reloaded = load(tmp_path / "run").eval()
    ids = IDS % 16
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids), result.model.eval()(input_ids=ids))


def test_psoftmax_p1_with_a_gain_refuses_a_moving_knob_in_one_line():
    model = _psoftmax_model(1.0, 1.0)
    with pytest.raises(RetrofitError, match=r"^psoftmax p=1 with a gain cannot move its p to 1.5: .*undefined at "
                                            r"p = 1; set patch.p > 1") as err:
        set_schedule_position(model, 0.5, start=2.0)
    assert "\n" not in str(err.value)
    set_schedule_position(model, 1.0)  # start 1 -> end 1: nothing moves, nothing divides
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=IDS).logits).all()
    plain = tiny_model("llama").eval()
    retrofit.patch(plain, "psoftmax", p=1.0)  # without a gain, p = 1 schedules like any p
    assert set_schedule_position(plain, 0.5, start=2.0) == [1.5, 1.5]


def test_kl_with_a_teacher_that_rules_a_token_out_is_finite_and_exact():
    teacher = torch.log_softmax(torch.tensor([[0.0, 1.0, float("-inf")]]), -1)
    student_logits = torch.tensor([[0.5, 0.2, 0.1]], requires_grad=True)
    student = torch.log_softmax(student_logits, -1)
    kl = kl_per_position(teacher, student)
    p0, p1 = 1 / (1 + math.e), math.e / (1 + math.e)  # the teacher's two possible tokens
    s = torch.log_softmax(torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64), -1).tolist()
    expected = p0 * (math.log(p0) - s[0]) + p1 * (math.log(p1) - s[1])  # the -inf token adds 0 * log 0 = 0
    assert torch.isfinite(kl).all() and abs(kl.item() - expected) < 1e-6
    kl.sum().backward()
    assert torch.isfinite(student_logits.grad).all()
    naive = (teacher.exp() * (teacher - student)).sum(-1)  # the old form: NaN
    assert torch.isnan(naive).all()
    finite = torch.log_softmax(torch.tensor([[0.0, 1.0, -2.0]]), -1)  # elsewhere: exactly the usual sum
    assert torch.equal(kl_per_position(finite, student), (finite.exp() * (finite - student)).sum(-1))
