"""AVNorm mode=beyond: the original model, bitwise, for every position < L; beyond L each head's output times
(n / L)^b_h, with b_h calibrated on text inside L and trainable.

    pytest tests/norms/test_avnorm_beyond.py
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import retrofit
from retrofit.norms.avnorm import AVNorm, fit_exponents
from retrofit.recovery.schedule import is_patch_parameter, set_schedule_position
from tests.tiny import TINY, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

L = 16
FAMILIES = list(TINY)  # every family test_patch.py's matrix covers


def patched(family, calibrate=True, **options):
    """(original, a copy patched with avnorm mode=beyond, calibrated on 2 x 40 tokens unless told not to)."""
    original = tiny_model(family)
    model = copy.deepcopy(original)
    retrofit.patch(model, "avnorm", mode="beyond", **{"ref_len": L, **options})
    if calibrate:
        retrofit.calibrate(model, [random_ids(2, 40, seed=5)])
    return original, model


def norms(model):
    return [m for m in model.modules() if isinstance(m, AVNorm)]


@pytest.mark.parametrize("family", FAMILIES)
def test_bitwise_inside_L_different_beyond(family):
    original, model = patched(family)
    ids = random_ids(2, 40)
    with torch.no_grad():
        want, got = original(ids).logits, model(ids).logits
    assert torch.equal(got[:, :L], want[:, :L])
    assert (got[:, L:] - want[:, L:]).abs().amax(-1).min() > 1e-6  # every position beyond L moves


def test_uncalibrated_is_the_original_everywhere_and_short_inputs_pass_through():
    original, model = patched("llama", calibrate=False)  # b_h = 0: the factor is exactly 1 at every n
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    _, model = patched("llama")
    with torch.no_grad():
        assert torch.equal(model(ids[:, :L]).logits, original(ids[:, :L]).logits)


def _head_outputs(model, ids):
    """The first layer's output-projection input (B, T, H*D): the heads' outputs after the norm."""
    seen = []
    proj = model.model.layers[0].self_attn.o_proj
    handle = proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen[0]


def test_the_calibrated_exponents_are_what_scales_each_head():
    original, model = patched("llama")
    b = norms(model)[0].exponent.detach()
    assert (b != 0).all() and (b.abs() <= 1).all()
    ids = random_ids(1, 40)
    want, got = _head_outputs(original, ids).view(1, 40, 4, 8), _head_outputs(model, ids).view(1, 40, 4, 8)
    n = torch.arange(1, 41, dtype=torch.float32)
    factor = (n.clamp_min(L) / L)[:, None] ** b[None, :]  # (T, H)
    torch.testing.assert_close(got, want * factor[None, :, :, None], rtol=1e-6, atol=1e-7)


def test_fit_recovers_a_power_law():
    b = torch.tensor([0.5, 0.1, -0.3])
    n = torch.arange(L + 1, dtype=torch.float64)
    counts = torch.zeros(L + 1, 3, dtype=torch.float64)
    counts[1:] = 3.0
    sums = counts * 2.0 * n.clamp_min(1)[:, None] ** (-b.double())[None, :]
    torch.testing.assert_close(fit_exponents(sums, counts).float(), b)
    counts[3:] = 0  # positions 1, 2 only: one usable point, no slope
    with pytest.raises(retrofit.RetrofitError, match="at least 3 tokens"):
        fit_exponents(sums, counts)


def test_calibration_sees_only_text_inside_L_and_skips_padding():
    _, model = patched("llama", calibrate=False)
    ids = random_ids(2, 40, seed=5)
    retrofit.calibrate(model, [ids[:, :L]])
    inside = torch.cat([n.exponent.detach().clone() for n in norms(model)])
    retrofit.calibrate(model, [ids])  # tokens beyond L add nothing
    assert torch.equal(torch.cat([n.exponent.detach() for n in norms(model)]), inside)
    padded, mask = torch.zeros(2, L + 5, dtype=torch.long), torch.zeros(2, L + 5, dtype=torch.long)
    padded[:, 5:], mask[:, 5:] = ids[:, :L], 1  # left padding: n counts the real keys only
    retrofit.calibrate(model, [{"input_ids": padded, "attention_mask": mask}])
    torch.testing.assert_close(torch.cat([n.exponent.detach() for n in norms(model)]), inside, rtol=1e-4, atol=1e-5)


def test_kv_cache_and_left_padding():
    _, model = patched("llama")
    ids = random_ids(1, 30)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :12], use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for t in range(12, 30):  # decoding across L: one query at a time, n from the cache
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
        torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-5, rtol=1e-5)
        short = random_ids(1, 24, seed=4)[0]
        batch, mask = torch.zeros(2, 30, dtype=torch.long), torch.zeros(2, 30, dtype=torch.long)
        batch[0], mask[0] = ids[0], 1
        batch[1, 6:], mask[1, 6:] = short, 1
        together = model(input_ids=batch, attention_mask=mask).logits
        torch.testing.assert_close(together[1, 6:], model(short[None]).logits[0], atol=1e-5, rtol=1e-5)


def test_trainable_exponents_are_patch_parameters():
    _, model = patched("qwen2")
    names = [n for n, p in model.named_parameters() if is_patch_parameter(n)]
    assert names and all(n.endswith(".retrofit.exponent") for n in names)
    assert not any(n.endswith(".retrofit.gain") for n, _ in model.named_parameters())
    ids = random_ids(2, 40)
    model(input_ids=ids, labels=ids).loss.backward()
    for norm in norms(model):
        assert norm.exponent.grad is not None and norm.exponent.grad.abs().min() > 0
    model.zero_grad(set_to_none=True)
    model(input_ids=ids[:, :L], labels=ids[:, :L]).loss.backward()  # inside L the exponent takes no part
    assert all(norm.exponent.grad is None for norm in norms(model))


@pytest.mark.parametrize("rope", ["yarn:4", "dynamic:4"])
def test_composes_with_rope_and_L_is_the_original_positions(rope):
    base = tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(base, "softmax", rope=rope)
    model = tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(model, "avnorm", mode="beyond", rope=rope)
    assert norms(model)[0].ref_len == L  # yarn raises max_position_embeddings to 4 L; dynamic leaves it
    assert model.config.max_position_embeddings == (4 * L if rope.startswith("yarn") else L)
    retrofit.calibrate(model, [random_ids(2, L, seed=5)])
    ids = random_ids(2, 40)
    with torch.no_grad():
        want, got = base(ids).logits, model(ids).logits
    assert torch.equal(got[:, :L], want[:, :L])  # L = 16 (the original), not the raised 64
    assert (got[:, L:] - want[:, L:]).abs().amax(-1).min() > 1e-6


def test_save_reload_and_unpatch(tmp_path):
    original, model = patched("gemma2")
    record = model.config.retrofit
    assert record["options"]["mode"] == "beyond" and record["options"]["ref_len"] == L
    assert record["calibration"]["tokens"] == 80 and "exponent_mean" in record["calibration"]
    model.save_pretrained(tmp_path)
    loaded = retrofit.from_pretrained(str(tmp_path))
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.config.retrofit["options"] == record["options"]
    retrofit.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
    assert not any(isinstance(m, AVNorm) for m in model.modules())


def test_plain_avnorm_is_unchanged_by_the_option():
    a, b = tiny_model("llama"), tiny_model("llama")
    retrofit.patch(a, "avnorm")
    retrofit.patch(b, "avnorm", mode="always")
    ids = random_ids(2, 20)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    assert a.config.retrofit["options"]["mode"] == "always"


@pytest.mark.parametrize("options,match", [
    ({"mode": "beyon"}, "mode must be one of always, beyond.*did you mean 'beyond'"),
    ({"mode": "beyond", "kind": "layer"}, "mode=beyond rescales each head's output by length and has no kind=layer"),
    ({"mode": "beyond", "floor": 2.0}, "mode=beyond takes no floor, affine or gain"),
    ({"mode": "beyond", "affine": True}, "mode=beyond takes no floor, affine or gain"),
    ({"exponent": 0.5}, "exponent and ref_len apply to mode=beyond only"),
    ({"mode": "beyond", "exponent": "x"}, "exponent must be a number"),  # the schema: a string is no number
    ({"mode": "beyond", "exponent": math.inf}, "exponent must be finite"),
    ({"mode": "beyond", "ref_len": 1}, "ref_len must be an integer >= 2"),
])
def test_bad_options(options, match):
    model = tiny_model("llama")
    with pytest.raises(retrofit.RetrofitError, match=match) as err:
        retrofit.patch(model, "avnorm", **options)
    assert "\n" not in str(err.value) and not retrofit.is_patched(model)


def test_a_floor_schedule_is_refused():
    _, model = patched("llama", calibrate=False)
    with pytest.raises(retrofit.RetrofitError, match="recovery.schedule.start 8: avnorm mode=beyond takes no floor"):
        set_schedule_position(model, 0.0)


def test_a_recipe_calibrates_and_trains_the_exponents_and_the_run_reloads_as_trained(tmp_path):
    from retrofit.recipe import recipe_from_dict
    from retrofit.train import train
    from tests.train.test_train import write_corpus
    folder = write_corpus(tmp_path)
    raw = {"model": {"config": {"model_type": "llama", **TINY["llama"]}, "tokenizer": str(folder / "tok")},
           "patch": {"norm": "avnorm", "mode": "beyond", "ref_len": L, "calibrate_tokens": 256},
           "data": {"task": "lm", "files": [str(folder / "text.txt")], "seq_len": 32, "val_blocks": 2,
                    "cache_dir": str(folder / "cache")},
           "train": {"steps": 3, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 1,
                     "progress": False},
           "eval": {"batches": 1, "batch_size": 2, "at_steps": [0]},
           "recovery": {"patch_lr": 0.1},
           "output": {"dir": str(tmp_path / "run")}}
    at_start = []

    def before_training(event, step, info):
        if event == "eval" and step == 0:
            at_start.extend(n.exponent.detach().clone() for n in norms(info["model"]))

    result = train(recipe_from_dict(raw), callbacks=[before_training])
    record = result.model.config.retrofit
    assert record["calibration"]["tokens"] == 256 and record["options"]["mode"] == "beyond"
    calibrated, trained = torch.cat(at_start), torch.cat([n.exponent.detach() for n in norms(result.model)])
    assert (calibrated != 0).all() and (calibrated.abs() <= 1).all()  # fitted from the recipe's own data
    assert (trained != calibrated).all()  # the patch group trained every head's exponent
    reloaded = retrofit.from_pretrained(str(tmp_path / "run"))
    ids = random_ids(2, 40)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, result.model.eval()(ids).logits)


def test_text_calibration_rows_reach_L_for_the_exponent_and_stay_512_for_gains():
    """`retrofit patch --calibration-text` and eval variants: the exponent's fit spans n in [N // 16, N] of the
    longest row, so rows are L long (here 1024 > 512); a gain is a mean over tokens, 512-token rows as before."""
    from retrofit.calibration import text_rows
    ids = torch.arange(3000) % 50 + 3
    _, beyond = patched("llama", calibrate=False, ref_len=1024)
    assert [r.shape for r in text_rows(beyond, ids)] == [(1, 1024), (1, 1024), (1, 952)]
    gains = tiny_model("llama")
    retrofit.patch(gains, "avnorm", kind="rms")
    assert [r.shape[1] for r in text_rows(gains, ids)] == [512] * 5 + [440]
    assert torch.equal(torch.cat([r[0] for r in text_rows(beyond, ids)]), ids)
