"""`retrofit train RECIPE --dry-run`: the peak memory a recipe's training will need, before anything loads.

    retrofit train recipes/gpt2-avnorm-retrofit.yaml --dry-run                 # this machine (CUDA, else CPU RAM)
    retrofit train RECIPE data.seq_len=32768 --dry-run --plan-for cuda:80      # an 80 GiB GPU instead

The model is built on the meta device from its config (no weights are read), so planning a 1B model takes
seconds. The prediction is retrofit.memory.plan_training (weights and AdamW, plus the larger of the backward's two
moments: saved activations with one chunk of logits, or every gradient with one recomputed layer; on the CPU
what the process already holds); `retrofit bench train --memory` prints it beside the
measured peak. Also: the longest data.seq_len that fits at this micro-batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import RetrofitError
from ..memory import count_parameters, plan_training

GIB = 2 ** 30
MOST_GIB = 1 << 20  # a petabyte-class machine; a planned device beyond it is a typo


def recipe_config(recipe):
    """The model config a recipe trains (its source's config.json / GGUF header, or model.config)."""
    from transformers import AutoConfig

    m = recipe.model
    if m.source is not None:
        return source_config(m.source, m.revision)
    cfg = dict(m.config or {})
    if "model_type" not in cfg:
        raise RetrofitError("model.config needs a model_type to plan memory (or name model.source)")
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def source_config(source, revision=None):
    """The config of the base model a source trains: a plain or patched folder's (the patch record and its save guard
    dropped: the planner builds the base on the meta device, and the patch adds a few floats per head), an adapter's
    base, a LoRA run's recipe's base."""
    from ..load import load_config, resolve_source
    from ..load.adapters import ADAPTER_CONFIG, read_record
    from ..recipe import load_recipe
    from ..record import drop_record

    folder = Path(resolve_source(source)).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        if (folder / ADAPTER_CONFIG).is_file():
            meta = read_record(folder)
            return source_config(meta["base_model"], meta.get("base_revision"))
        if (folder / "adapter").is_dir() and (folder / "recipe.yaml").is_file():
            return recipe_config(load_recipe(folder / "recipe.yaml"))
    config = load_config(source, revision)
    drop_record(config)
    return config


def parse_plan_for(text: str | None) -> tuple[str, int | None]:
    """--plan-for cpu:24 | cuda:80 | cuda -> (device type, bytes or None = this machine's)."""
    if not text:
        return ("cuda" if torch.cuda.is_available() else "cpu"), None
    kind, _, size = text.partition(":")
    if kind not in ("cpu", "cuda"):
        raise RetrofitError(f"--plan-for must be cpu[:GiB] or cuda[:GiB], got {text!r}")
    try:
        gib = float(size) if size else None
    except ValueError:
        gib = math.nan
    if gib is not None and not (math.isfinite(gib) and 0 < gib <= MOST_GIB):  # 1e400 is inf: int() of it raised
        raise RetrofitError(f"--plan-for: the memory after ':' must be a finite number of GiB, at most {MOST_GIB:,} "
                            f"(cpu:24, cuda:80), got {size!r}")
    return kind, int(gib * GIB) if gib is not None else None


def device_bytes(kind: str) -> int:
    """The memory a run on this machine may use: the GPU's total, or the machine's RAM."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RetrofitError("no CUDA device here: name its memory, e.g. --plan-for cuda:80")
        return torch.cuda.get_device_properties(0).total_memory
    import psutil  # ships with accelerate

    return psutil.virtual_memory().total


def plan_recipe(recipe, plan_for: str | None = None) -> dict:
    """The prediction for `recipe` on `plan_for`'s device: parts (bytes), total, the memory there, fits, and the
    longest data.seq_len (a power of two times 1024, or the recipe's own) that fits at this micro-batch."""
    t = recipe.train
    kind, memory = parse_plan_for(plan_for)
    memory = memory or device_bytes(kind)
    config = recipe_config(recipe)
    params = count_parameters(config)
    trainable = None
    if t.peft is not None:  # adapters only: a rank-r pair per targeted projection, roughly 1% of the weights
        trainable = max(1, params // 100)
    precision = t.precision if t.precision != "auto" else ("bf16" if kind == "cuda" else "fp32")

    def at(length: int) -> dict:
        return plan_training(config, params, tokens=t.micro_batch_size * length, rows=t.micro_batch_size,
                             precision=precision, checkpointing=t.gradient_checkpointing,
                             chunk_tokens=t.loss_chunk_tokens, trainable=trainable,
                             process_bytes=0 if kind == "cuda" else None)

    parts = at(recipe.data.seq_len)
    longest, length = None, 1024
    while at(length)["total"] <= memory and length <= 2 ** 24:
        longest, length = length, length * 2
    return {"device": kind, "device_bytes": memory, "parameters": params, "precision": precision, "parts": parts,
            "fits": parts["total"] <= memory, "longest_fitting_seq_len": longest, "seq_len": recipe.data.seq_len,
            "micro_batch_size": t.micro_batch_size}


def describe(plan: dict) -> str:
    """The plan as the lines `retrofit train --dry-run` prints."""
    parts = plan["parts"]
    lines = [f"plan: {plan['parameters'] / 1e6:,.1f}M parameters, data.seq_len {plan['seq_len']:,} x micro-batch "
             f"{plan['micro_batch_size']}, {plan['precision']}, on {plan['device']} "
             f"({plan['device_bytes'] / GIB:,.1f} GiB)"]
    lines += [f"  {name:12} {value / GIB:9.2f} GiB" for name, value in parts.items() if name != "total"]
    lines.append(f"  {'peak':12} {parts['total'] / GIB:9.2f} GiB predicted: "
                 + ("fits" if plan["fits"] else "does NOT fit") + " (the larger of the loss and the layers moments)")
    longest = plan["longest_fitting_seq_len"]
    lines.append(f"  longest data.seq_len that fits (powers of two from 1024): "
                 f"{f'{longest:,}' if longest else 'none'}")
    return "\n".join(lines)
