"""A vLLM engine for a retrofit checkpoint, checked in this process first.

    llm = load_llm("runs/smollm2-avnorm", dtype="float32")     # vllm.LLM; any LLM keyword passes through

vLLM builds the model in its engine process, where a refusal (retrofit.serve.plan) ends its start-up with a long
log; `load_llm` reads the same plan from config.json here first, so a checkpoint vLLM cannot serve exactly is
refused in one line before any engine starts, and so is an environment whose VLLM_PLUGINS leaves the plugin out
(vLLM would then serve a patched Llama as a plain one, silently).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import RetrofitError, read_utf8
from .plan import ServePlan, serve_plan

PLUGIN = "retrofit"  # our entry point's name in vLLM's plugin group (pyproject.toml)


def checkpoint_plan(folder: str | os.PathLike) -> ServePlan | None:
    """The ServePlan of a local checkpoint folder's config.json (None: not patched)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise RetrofitError(f"{folder} has no config.json: pass a saved model folder (retrofit patch --out, "
                            "save_pretrained, a training run's model)")
    try:
        config = json.loads(read_utf8(path))
    except json.JSONDecodeError as err:
        raise RetrofitError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    return serve_plan(config, where=str(folder))


def check_plugin_enabled() -> None:
    """vLLM loads every installed plugin unless VLLM_PLUGINS names the ones to load."""
    chosen = os.environ.get("VLLM_PLUGINS")
    if chosen is not None and PLUGIN not in [name.strip() for name in chosen.split(",")]:
        raise RetrofitError(f"VLLM_PLUGINS={chosen!r} leaves out {PLUGIN!r}: vLLM would serve a patched model as "
                            "the original; add it, or unset VLLM_PLUGINS")


def load_llm(folder: str | os.PathLike, **engine):
    """vllm.LLM(model=folder, **engine) once the checkpoint's plan and the plugin are checked."""
    plan = checkpoint_plan(folder)
    if plan is not None:
        check_plugin_enabled()
    try:
        import vllm
    except ImportError:
        raise RetrofitError("vLLM is not installed here: install retrofit's serve extra in its own environment "
                            "(docs/serving.md)") from None
    return vllm.LLM(model=str(folder), **engine)


def eval_engine(folder: str | os.PathLike, max_model_len: int, dtype: str | None = None, device: str = "cpu"):
    """The vllm.LLM `retrofit eval --engine vllm` runs a checkpoint with: prompts go in as token ids (the tokenizer
    stays retrofit's), dtype as asked (default float32), a KV cache sized for one sequence of max_model_len on
    the CPU (vLLM's CPU default reserves 92% of the memory)."""
    engine = dict(dtype=dtype if dtype not in (None, "auto") else "float32", skip_tokenizer_init=True, seed=0,
                  max_model_len=max_model_len, max_num_seqs=1, enforce_eager=device == "cpu")
    if device == "cpu":
        engine["kv_cache_memory_bytes"] = max(64 << 20, kv_bytes_per_token(folder) * max_model_len * 2)
    return load_llm(folder, **engine)


def kv_bytes_per_token(folder) -> int:
    """K and V of one token in every layer, in float32 (the largest dtype eval runs)."""
    config = json.loads(read_utf8(Path(folder) / "config.json"))
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head_dim * 4


def vllm_greedy_answer(llm, tokenizer, text: str, max_new_tokens: int, stop: str) -> str:
    """evaluate.ruler.greedy_answer through vLLM: the same token ids in, greedy, stopped at the checkpoint's EOS
    tokens (as transformers' generate stops), decoded without special tokens and cut at `stop`."""
    import vllm
    from transformers import GenerationConfig

    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    try:  # what generate stops at: the saved generation config, else the one made from the model's config
        eos = GenerationConfig.from_pretrained(llm.model_config.model).eos_token_id
    except OSError:
        eos = GenerationConfig.from_model_config(llm.model_config.hf_config).eos_token_id
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False,
                                 stop_token_ids=[e for e in (eos if isinstance(eos, list) else [eos]) if e is not None])
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    answer = tokenizer.decode(list(out), skip_special_tokens=True)
    return answer.split(stop)[0] if stop else answer
