"""DeepSpeed's ALST (Arctic Long Sequence Training) as the engine's sequence parallelism: train.sequence_parallel N
under train.deepspeed or an accelerate DeepSpeed config.

    accelerator = Accelerator(..., parallelism_config=zero.parallelism_config(N, world))   # ALST in prepare()
    with preparing(model, layout):                 # ALST checks it wraps the model's own implementation
        model, optimizer = accelerator.prepare(model, optimizer)
    with sharded(model, layout):                   # each training forward and backward, as under retrofit's Ulysses
        loss = loss_sum(model, shard(batch, layout), "lm")

DeepSpeed's UlyssesSPAttentionHF moves q, k, v between token and head layouts (its all-to-all, its groups of
consecutive ranks: the same layout as retrofit's) and calls the core attention it wraps on (B, H/N, T, D) — here
`alst_attention`, which runs the model's own implementation (sdpa, eager, a retrofit norm) through the same
`on_my_heads` as retrofit's Ulysses: the norm's per-head tensors sliced to the rank's heads (SSMax s, softmax+1
sinks, AVNorm beyond's exponents, heads= selections, a model's own sinks), the causal mask built for eager, GQA's
groups kept. Measured without it (DESIGN, fifth round): SSMax and softmax+1 fail ("s_param must have one value per
query head (2); got (4,)"). Two shape facts ALST needs adapting to are handled in `preparing`: it reads
num_key_value_heads (GPT-2's config has none) and returns (B, T/N, H*D) where GPT-2 expects (B, T/N, H, D).
"""

from __future__ import annotations

import contextlib

from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .sequence_parallel import ALST_NAME, SequenceLayout, inner_model, layout_of, on_my_heads, sharded, ulysses_mask


def alst_attention(module, query, key, value, attention_mask, **kwargs):
    """The core attention DeepSpeed's ALST (UlyssesSPAttentionHF) wraps under train.deepspeed / an accelerate
    DeepSpeed config: ALST has already moved q, k, v to (B, H/N, T, D), this rank's heads over the whole row (and
    repeated KV heads when N exceeds them); what retrofit adds is the norm's per-head tensors sliced to those heads
    (SSMax s, softmax+1 sinks, AVNorm beyond's exponents, heads= selections, a model's own sinks)."""
    layout, wrapped = layout_of(module, ALST_NAME)
    return on_my_heads(module, query, key, value, kwargs, layout.rank, layout.size, wrapped), None


def reset_alst() -> None:
    """DeepSpeed's ALST replaces the function registered under ALST_NAME by its wrapper around it and keeps its
    groups, for the life of the process: a later run in the process (the experiment driver, tests) starts again
    from retrofit's adapter and from no sequence-parallel groups."""
    ALL_ATTENTION_FUNCTIONS[ALST_NAME] = alst_attention  # where ALST put its wrapper (the instance's mapping)
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    parallel_state_sp._release_sequence_parallel_groups()


@contextlib.contextmanager
def preparing(model: nn.Module, layout: SequenceLayout | None):
    """Around the registration of DeepSpeed's ALST (accelerate's prepare() under layout.alst; else nothing): ALST
    checks that the implementation it wraps is the model's, so the model is set up as it runs sharded; and it reads
    num_key_value_heads, which multi-head configs such as GPT-2's do not name (they have as many as query heads)."""
    if layout is None or not layout.alst:
        yield model
        return
    config = inner_model(model).config.get_text_config()
    unnamed = getattr(config, "num_key_value_heads", None) is None
    if unnamed:
        config.num_key_value_heads = config.num_attention_heads
    try:
        with sharded(model, layout):
            yield model
    finally:
        if unnamed:
            del config.num_key_value_heads
        registered = ALL_ATTENTION_FUNCTIONS[ALST_NAME]
        if registered is not alst_attention and not getattr(registered, "heads_shaped", False):
            ALL_ATTENTION_FUNCTIONS[ALST_NAME] = _heads_shaped(registered)


def _heads_shaped(alst_wrapper):
    """ALST returns (B, T/N, H*D); transformers' contract is (B, T/N, H, D), which GPT-2's attention relies on
    (it flattens the last two dimensions, where Llama's reshapes to the input's shape)."""
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = alst_wrapper(module, query, key, value, attention_mask, *args, **kwargs)
        return out.view(*out.shape[:2], -1, query.shape[-1]), weights

    attention.heads_shaped = True
    return attention


AttentionInterface.register(ALST_NAME, alst_attention)  # DeepSpeed's ALST replaces it by its wrapper around it
AttentionMaskInterface.register(ALST_NAME, ulysses_mask)
