"""AVNorm over any attention implementation: it acts on the output projection's input, so sdpa, eager and
flex_attention give today's logits, a switch of implementation after patching keeps it, and LoRA on o_proj
sees the normalized input. Kernel norms run retrofit's kernels whatever the model was loaded with, survive a
switch to sdpa/eager and refuse one that would drop them."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import retrofit
from retrofit.errors import RetrofitError
from retrofit.norms import get_norm, make_options, patched_norms
from retrofit.recovery import patch_bypassed
from tests.tiny import random_ids, randomize_patch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# Every registered norm but the baseline with its example options (a new norm joins by registering), and AVNorm's
# LayerNorm kind with an affine weight besides.
NORMS = [(n, get_norm(n).example_options) for n in patched_norms()] + [("avnorm", {"kind": "layer", "affine": True})]


def _reference(model_type, norm, options, ids):
    """Today's path: the model loaded with sdpa, patched (AVNorm through the hook, the others their kernels)."""
    model = tiny_model(model_type)
    retrofit.patch(model, norm, **options)
    randomize_patch(model)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _flex_available():
    try:
        tiny_model("llama", attn_implementation="flex_attention")
        return True
    except Exception:  # noqa: BLE001  (a torch build or transformers version without flex on this device)
        return False


IMPLEMENTATIONS = ["sdpa", "eager"] + (["flex_attention"] if _flex_available() else [])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("norm, options", NORMS, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in NORMS])
def test_every_norm_under_every_implementation_gives_todays_logits(norm, options, implementation):
    ids = random_ids(2, 12)
    model = tiny_model("llama", attn_implementation=implementation)
    report = retrofit.patch(model, norm, **options)
    randomize_patch(model)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, _reference("llama", norm, options, ids), atol=1e-5, rtol=1e-5)
    if get_norm(norm).on_output(make_options(norm, **options)):  # the model keeps its own implementation
        assert model.config._attn_implementation == implementation
    else:
        assert model.config._attn_implementation.startswith("retrofit")
    assert report.base_attn_implementation == implementation
    retrofit.unpatch(model)
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_avnorm_survives_an_implementation_switch(model_type):
    ids = random_ids(2, 12)
    model = tiny_model(model_type)
    retrofit.patch(model, "avnorm")
    randomize_patch(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    plain = tiny_model(model_type)
    with torch.no_grad():
        assert (model(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max() > 1e-3  # still patched


def test_a_kernel_norm_follows_a_switch_to_eager_and_refuses_one_that_would_drop_it():
    ids = random_ids(2, 12)
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "retrofit_eager"
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    with pytest.raises(RetrofitError, match="would drop the patch"):
        model.set_attn_implementation("flash_attention_2")
    retrofit.unpatch(model)
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")  # the class's own method again
    assert model.config._attn_implementation == "sdpa"


def test_unpatch_removes_the_hooks_and_a_deepcopy_keeps_its_own():
    ids = random_ids(2, 12)
    plain = tiny_model("llama")
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    randomize_patch(model)
    twin = copy.deepcopy(model)
    retrofit.unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)
        assert (twin(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max() > 1e-3  # the copy: patched
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_lora_on_o_proj_sees_the_normalized_input():
    ids = random_ids(2, 12)
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    randomize_patch(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False))
    lora.eval()
    with torch.no_grad():
        with_lora = lora(input_ids=ids).logits
        merged = lora.merge_and_unload()(input_ids=ids).logits
    assert (with_lora - before).abs().max() > 1e-4  # the adapter acts
    # merging folds the adapter into o_proj: equal only if the adapter saw the same (normalized) input
    torch.testing.assert_close(merged, with_lora, atol=1e-5, rtol=1e-5)


def test_the_teacher_bypass_turns_the_hook_off():
    ids = random_ids(2, 12)
    plain = tiny_model("llama")
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    randomize_patch(model)
    with torch.no_grad(), patch_bypassed(model):
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)


def test_kernel_norms_refuse_paged_attention_and_hub_kernels_but_avnorm_does_not():
    for name in ("paged|sdpa", "kernels-community/flash-attn"):
        model = tiny_model("llama")
        model.config._attn_implementation = name  # what loading with it would set (not runnable on this CPU)
        with pytest.raises(RetrofitError, match="avnorm works over any implementation"):
            retrofit.patch(model, "psoftmax")
        retrofit.patch(model, "avnorm")
        assert model.config._attn_implementation == name and model.config.retrofit["base_attn_implementation"] == name


def test_calibration_refuses_sharded_patch_parameters():
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    gain = next(p for n, p in model.named_parameters() if n.endswith("retrofit.gain"))
    gain.ds_id = 7  # what DeepSpeed ZeRO-3 puts on a partitioned parameter
    with pytest.raises(RetrofitError, match="sharded"):
        retrofit.calibrate(model, [random_ids(1, 8)])
