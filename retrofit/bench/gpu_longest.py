"""The `longest` part of `retrofit bench gpu`: how long one sequence can be and still train on this GPU, per norm,
beside what `retrofit train RECIPE --dry-run --plan-for cuda:GiB` predicts for the very same run.

    retrofit bench gpu --parts longest --model smollm2-135m --random-init --out gpu

One sequence per step (batch 1), bf16, gradient checkpointing, the loss as train.loss_chunk_tokens says (Liger's
fused loss on CUDA where it is installed), two optimizer steps (AdamW's moments exist from the second, as the planner
assumes). From sizes["long_start"] tokens, doubling up to sizes["long_max"]: every arm at one length before any arm
at the next, so the part's time budget cuts the longest lengths, not a norm; an arm that ran out of memory is not
tried longer. Each row: the peak allocated memory, the second step's seconds, and the planner's predicted peak for
this recipe (one prediction per length: the planner does not model the norms). The data are random token ids.
"""

from __future__ import annotations

import sys
import time

GIB = 2 ** 30
CONFIG_NOISE = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "retrofit")


def planner_config(config) -> dict:
    """The model config as a recipe's model.config (what --dry-run plans from when no model.source is named)."""
    values = {k: v for k, v in config.to_diff_dict().items() if k not in CONFIG_NOISE}
    return {"model_type": config.model_type, **values}


def planned(config, arm: str, seq_len: int, plan_for: str, device: str) -> dict:
    """retrofit/train/dry_run.py's prediction for the recipe this part trains at seq_len: bytes and longest fit."""
    from ..recipe import recipe_from_dict
    from ..train.dry_run import plan_recipe
    from .gpu_train import bench_recipe

    recipe = recipe_from_dict(bench_recipe(planner_config(config), arm, device, 1, seq_len, 2, "unused",
                                           gradient_checkpointing=True))
    plan = plan_recipe(recipe, plan_for)
    return {"predicted_mb": round(plan["parts"]["total"] / 2 ** 20), "longest_fitting": plan["longest_fitting_seq_len"]}


def _lengths(sizes) -> list[int]:
    lengths, length = [], sizes["long_start"]
    while length <= sizes["long_max"]:
        lengths.append(length)
        length *= 2
    return lengths


def _device_gib(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GIB


def _row(base, arm, args, sizes, seq_len) -> dict:
    import torch

    from .gpu_train import finetune_arm

    try:
        run = finetune_arm(base, arm, args, sizes, batch=1, seq_len=seq_len, steps=2, gradient_checkpointing=True)
        step_s = round(seq_len / run["tokens_per_s"], 2) if run.get("tokens_per_s") else None
        return dict(run, seq_len=seq_len, step_s=step_s)
    except torch.OutOfMemoryError as err:  # the answer this part looks for, not a failure
        return {"norm": arm, "seq_len": seq_len, "out_of_memory": True, "error": f"out of memory: "
                f"{str(err).splitlines()[0][:160]}"}
    except Exception as err:
        return {"norm": arm, "seq_len": seq_len, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def part_longest(args, sizes) -> dict:
    from .gpu_train import arms, base_model, progress, release_memory

    base, source = base_model(args)
    base.config.max_position_embeddings = max(base.config.max_position_embeddings or 0, sizes["long_max"])
    gib = _device_gib(args.device)
    plan_for = f"cuda:{gib:.1f}" if gib else "cpu"
    runs, stopped, start, budget = [], set(), time.perf_counter(), sizes["budgets"]["longest"]
    plans = {T: planned(base.config, "unpatched", T, plan_for, args.device) for T in _lengths(sizes)}
    for seq_len in _lengths(sizes):
        for arm in arms():
            if arm in stopped:
                continue
            if time.perf_counter() - start > budget:
                runs.append({"norm": arm, "seq_len": seq_len, "skipped": f"over the part's {budget:g} s budget"})
                continue
            row = dict(_row(base, arm, args, sizes, seq_len), **plans[seq_len])
            if "predicted_mb" in row and row.get("peak_memory_mb"):
                row["predicted_over_measured"] = round(row["predicted_mb"] / row["peak_memory_mb"], 3)
            if "error" in row:
                stopped.add(arm)
            runs.append(row)
            release_memory(args.device)
            progress(args, {"runs": runs})
            print(f"bench gpu: longest {arm} T={seq_len} done", file=sys.stderr, flush=True)
    trained = {arm: max((r["seq_len"] for r in runs if r["norm"] == arm and r.get("loss_finite")), default=None)
               for arm in arms()}
    return {"model": source, "model_type": base.config.model_type, "precision": "bf16", "steps": 2, "batch": 1,
            "gradient_checkpointing": True, "plan_for": plan_for, "data": "random token ids, seed 0",
            "planner_longest": plans[max(plans)]["longest_fitting"],
            "planner_longest_80": planned(base.config, "unpatched", sizes["long_start"], "cuda:80",
                                          args.device)["longest_fitting"],
            "longest_trained": trained, "runs": runs}
