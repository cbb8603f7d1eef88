"""What a loaded model cannot train, refused before the first step: lengths past its learned positions, packed
documents on an implementation that would let them see each other, a tokenizer larger than its embedding, a recovery
section the patch or the task cannot serve. (A recipe's files, selection and memory are checked earlier, before the
model is built: recipe_fits.py.)

    check_lengths(model, recipe)       # GPT-2: 1024 learned positions unless patch.nope
    check_packing(model, recipe)       # data.packing documents: sdpa, eager or flex_attention
    check_vocabulary(model, tokenizer)
    check_recovery(model, recipe)
"""

from __future__ import annotations

from torch import nn

from ..attention_seam import BASE_OF
from ..errors import RetrofitError, check_token_ids
from ..load import language_model
from ..positions import position_limit
from ..recipe import Recipe
from ..recovery import scheduled_norms
from ..recovery.schedule import endpoints


def check_lengths(model: nn.Module, recipe: Recipe) -> None:
    """Refuse, before training, lengths the model cannot represent (learned absolute positions)."""
    lm = language_model(model)
    longest = max([recipe.data.seq_len, *recipe.loop_eval_lengths()])
    limit = position_limit(lm)
    if limit is not None and longest > limit:
        raise RetrofitError(f"length {longest} (data.seq_len / eval.lengths) exceeds {lm.config.model_type}'s {limit} "
                            "learned positions; set patch.nope: true (with a patch.norm) or use shorter lengths")
    if recipe.data.task == "counting" and lm.config.vocab_size < recipe.data.counting.alphabet:
        raise RetrofitError(f"the model's vocabulary ({lm.config.vocab_size}) is smaller than "
                            f"data.counting.alphabet ({recipe.data.counting.alphabet})")


# transformers' implementations whose mask function builds each packed row's block-causal mask from its position-id
# resets (transformers' create_causal_mask). flash-attention reads the resets only from one flattened row (its varlen
# path runs at batch size 1, transformers' _is_packed_sequence): rows of several documents would attend across them.
# retrofit's own implementations register their base's mask function (attention_seam.IMPLEMENTATIONS): they pack as
# their base does (BASE_OF).
PACKED_MASKS = ("sdpa", "eager", "flex_attention")


def check_packing(model: nn.Module, recipe: Recipe) -> None:
    """data.packing documents needs an implementation that confines attention to each document (PACKED_MASKS)."""
    implementation = language_model(model).config._attn_implementation
    if recipe.data.packing == "documents" and BASE_OF.get(implementation, implementation) not in PACKED_MASKS:
        raise RetrofitError(f"data.packing documents: attention implementation {implementation!r} would let a row's "
                            "documents attend to each other; load the model with sdpa or eager")


def check_vocabulary(model: nn.Module, tokenizer) -> None:
    """The tokenizer's ids fit the model's embedding (a mismatched model.tokenizer is an IndexError in step 1)."""
    if tokenizer is not None and hasattr(tokenizer, "get_vocab"):
        rows = language_model(model).get_input_embeddings().num_embeddings
        check_token_ids(max(tokenizer.get_vocab().values()), rows, "the tokenizer (model.tokenizer)", "the model")


def check_recovery(model: nn.Module, recipe: Recipe) -> None:
    """Refuse, before training, a recovery section the patch or the task cannot serve (one-line errors)."""
    rec = recipe.section("recovery")
    if rec is None:
        return
    if recipe.patch.norm is None and (rec.distills() or rec.schedule or rec.patch_lr is not None or rec.freeze_base):
        raise RetrofitError("the recovery section needs a patch (patch.norm): a teacher, a schedule or a patch "
                            "learning rate on an unpatched model has nothing to act on")
    if rec.distills() and recipe.data.task != "lm":
        raise RetrofitError(f"recovery.kl_weight / match_steps distill next-token predictions; data.task is "
                            f"{recipe.data.task}: use the lm task or drop them")
    if rec.schedule is not None:
        need_steps = rec.schedule.steps
        if need_steps > recipe.train.steps:
            raise RetrofitError(f"recovery.schedule.steps ({need_steps}) exceeds train.steps ({recipe.train.steps}): "
                                "the run would end mid-schedule")
        norm = scheduled_norms(language_model(model))[0]  # a norm without a knob: one line naming those that have one
        endpoints(norm, rec.schedule.start, rec.schedule.end)  # an end its norm refuses (floor < 0): before training
        if rec.schedule.shape == "loss" and rec.schedule.costs is None and recipe.data.task != "lm":
            raise RetrofitError(f"recovery.schedule.shape loss without costs measures next-token losses, but "
                                f"data.task is {recipe.data.task}: give recovery.schedule.costs")
    if rec.match_steps >= recipe.train.steps:
        raise RetrofitError(f"recovery.match_steps ({rec.match_steps}) must be < train.steps ({recipe.train.steps})")
