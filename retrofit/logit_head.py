"""The logit head, once: final hidden states -> float32 logits as the model's own forward makes them, run a chunk
of positions at a time. Evaluation (evaluate/losses.py) and distillation (recovery/distill.py) both score with it.

    for part in chunk_slices(B, T, chunk_tokens):            # positions part of (B, T): about chunk_tokens each
        logits = head_logits(model, hidden[:, part])          # (B, c, d) -> (B, c, V): the only vocab-sized tensor

The final norm is the body's (the final hidden states callers pass are after it); the head is the output
projection then the family's logit transform (LOGIT_TRANSFORMS), read from the config or, for multimodal
configs such as Gemma 3's, from its `text_config`.
"""

from __future__ import annotations

import torch

# Families whose CausalLM head transforms logits after the output projection, keyed by the config
# attribute that turns it on. evaluate's `check_head` catches any family missing from this table.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": lambda x, cap: torch.tanh(x / cap) * cap,  # gemma2/3/4
    "logit_scale": lambda x, scale: x * scale,  # cohere
    "logits_scaling": lambda x, scale: x / scale,  # granite
}


def config_value(config, name):
    """config.<name>, else config.text_config.<name> (multimodal configs keep the language model's there)."""
    value = getattr(config, name, None)
    if value is None and getattr(config, "text_config", None) is not None:
        value = getattr(config.text_config, name, None)
    return value


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, d) final hidden states -> (B, T, V) float32 logits, as the model's own forward makes them."""
    logits = model.get_output_embeddings()(hidden).float()
    for name, transform in LOGIT_TRANSFORMS.items():
        value = config_value(model.config, name)
        if value is not None and not isinstance(value, bool):
            logits = transform(logits, float(value))
    return logits


def chunk_slices(rows: int, length: int, chunk_tokens: int) -> list[slice]:
    """Slices of the `length` positions of a (rows, length) batch, each about chunk_tokens tokens (at least one
    position): the head runs on one at a time, so peak memory grows with length, never with length x vocab."""
    step = max(1, chunk_tokens // rows)
    return [slice(s, s + step) for s in range(0, length, step)]
