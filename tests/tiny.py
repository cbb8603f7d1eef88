"""Tiny random models built in-process from configs: what every test uses instead of a download."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 97

# model_type -> the config keys that make it tiny. GQA (fewer KV heads) wherever the family has it.
TINY = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB, sliding_window=None),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB),
    "gemma": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, vocab_size=VOCAB),
    "gemma2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=64, vocab_size=VOCAB,
                   sliding_window=4096, attn_logit_softcapping=None, final_logit_softcapping=None),
    "phi3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
                 original_max_position_embeddings=64, pad_token_id=0),
}


# gemma2 has no sdpa path in transformers (soft-capping): it runs eager.
DEFAULT_ATTN = {"gemma2": "eager"}


def tiny_config(model_type: str = "llama", attn_implementation: str | None = None, **overrides):
    attn_implementation = attn_implementation or DEFAULT_ATTN.get(model_type, "sdpa")
    cfg = AutoConfig.for_model(model_type, **{**TINY[model_type], **overrides})
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(model_type: str = "llama", seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A freshly initialized tiny causal LM in eval mode, fp32, deterministic in `seed`."""
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, attn_implementation, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation)
    return model.eval()


def random_ids(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)
