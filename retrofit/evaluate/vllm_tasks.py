"""`retrofit eval --engine vllm`: the generation tasks (RULER-style) run by vLLM with retrofit's plugin.

    retrofit eval runs/smollm2-ssmax --engine vllm --tasks niah,vt --lengths 4096,8192 --data book.txt

The instances, the tokenizer, the stop rules and the scoring are the transformers path's (evaluate/ruler.py); only
the greedy continuation comes from vLLM (retrofit.serve.vllm_engine.vllm_greedy_answer), fed the same token ids. A
checkpoint is served with the patch it carries: evaluation patches, RoPE overrides and variants are the
transformers path's only (EvalSpec refuses them with --engine vllm).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

from ..errors import RetrofitError, read_utf8
from ..rope import describe_rope
from .ruler import evaluate_ruler

ENGINES = ("transformers", "vllm")


def check_engine(engine: str, tasks, ruler_task_names, on_the_fly: bool) -> None:
    """--engine: one of ENGINES; vllm runs generation tasks only, on checkpoints as saved."""
    if engine not in ENGINES:
        raise RetrofitError(f"unknown engine {engine!r}: choose {' or '.join(ENGINES)}")
    if engine == "transformers":
        return
    other = [t for t in tasks or ["lm"] if t not in ruler_task_names]
    if other:
        raise RetrofitError(f"--engine vllm runs the generation tasks ({', '.join(ruler_task_names)}), not "
                            f"{', '.join(other)}: run those with the default engine")
    if on_the_fly:
        raise RetrofitError("--engine vllm serves each checkpoint with the patch it carries: drop --patch, --rope "
                            "and --variants (or save the patched model with `retrofit patch --out` first)")


def vllm_entry(source, name: str, tokenizer_key, tokenizer, prepared: dict, spec) -> dict:
    """The results entry of one checkpoint folder whose RULER instances `prepared` vLLM answers."""
    from ..serve.vllm_engine import checkpoint_plan, eval_engine, vllm_greedy_answer

    if not isinstance(source, (str, Path)) or not (Path(source) / "config.json").is_file():
        raise RetrofitError(f"--engine vllm serves saved model folders; {name} is not one (save it with "
                            "`retrofit patch --out` or save_pretrained)")
    plan = checkpoint_plan(source)  # refused here in one line, before vLLM starts
    longest = max(i["tokens"] + i["max_new_tokens"] for insts in prepared.values() for i in insts)
    llm = eval_engine(source, longest + 16, spec.dtype, spec.device)  # 16: a tokenizer's count may differ slightly
    try:
        rows = evaluate_ruler(llm, tokenizer, prepared, progress=spec.progress, answer=vllm_greedy_answer)
        dtype = str(llm.model_config.dtype).removeprefix("torch.")
    finally:
        del llm
        gc.collect()
    config = json.loads(read_utf8(Path(source) / "config.json"))
    record = config.get("retrofit")
    return {"name": name, "source": str(source), "engine": "vllm", "model_type": config.get("model_type"),
            "tokenizer": tokenizer_key, "dtype": dtype, "retrofit": record, "max_learned_positions": None,
            "max_position_embeddings": config.get("max_position_embeddings"),
            "rope": describe_rope(record),
            "original_positions": plan.original_positions if plan else config.get("max_position_embeddings"),
            "eval_patch": None, "lengths": [], "ruler": rows}
