"""`retrofit bench decode MODEL`: KV-cache greedy decoding, unpatched vs each norm: prefill s and decode tokens/s.

    retrofit bench decode SmolLM2-135M-Instruct.Q4_1.gguf                 # 2048-token prompt, 64 new tokens
    retrofit bench decode runs/tiny --prompt-tokens 128 --new-tokens 8 --norms psoftmax,ssmax --out bench/
    retrofit bench decode gpt2 --threads 1 --repeats 5 --out bench-decode.json

MODEL is anything retrofit loads (a folder, a .gguf file, a Hub id); a retrofit checkpoint is unpatched
first, so the baseline is its base model. The prompt is --prompt-tokens random token ids from a seeded
generator (decoding speed does not depend on the text). Each arm (unpatched, then each norm patched onto
the same model and unpatched again after) runs prefill (one forward of the prompt, filling the KV cache)
and then --new-tokens greedy steps of one token each, timed separately. avnorm runs uncalibrated
(calibration sets gains, not speed); psoftmax uses --p. The arms alternate within each repeat, so a
neighbour's burst on a shared machine hits all of them alike; each arm gets one short warm-up first, and
the table reports medians over --repeats. Targets: time per decoded token at most 1.15x the
unpatched model's for psoftmax, 1.05x for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text

DEFAULT_TARGET = 1.05
OUT_KIND = "file-or-folder"  # --out FILE, or an existing folder to write bench-decode.json into (commands/bench.py)
FILE_NAME = "bench-decode.json"
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a model folder, .gguf file or Hub id")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (random ids, seeded)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy decoding steps after the prompt")
    parser.add_argument("--norms", default=None, help="comma list of norms to compare with the unpatched model "
                        "(default: every registered norm but the baseline, with its example options)")
    parser.add_argument("--p", type=float, default=2.0, help="p of psoftmax")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per arm; medians are reported")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--out", default=FILE_NAME, help=f"JSON file, or an existing folder for {FILE_NAME}")


def _norms(text: str | None) -> list[str]:
    from ..norms import available_norms, patched_norms

    if text is None:
        return patched_norms()
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in available_norms()]
    if unknown or not names:
        raise RetrofitError(f"unknown --norms {unknown or text!r}: choose from {', '.join(available_norms())}")
    return list(dict.fromkeys(names))  # in order, once each


def out_path(out) -> Path:
    """--out as the JSON file to write: an existing folder (or one named with a trailing /) gets FILE_NAME."""
    path = Path(os.path.expanduser(str(out)))
    return path / FILE_NAME if path.is_dir() or str(out).endswith(os.sep) else path


def _positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def _load(args):
    import torch

    from ..load import load
    from ..patching import is_patched, unpatch
    from ..record import read_record

    model = load(args.model, task_head=False, dtype=torch.float32)
    note = None
    if is_patched(model):
        note = f"{args.model} is patched with {read_record(model)['norm']}: its base model is the baseline"
        unpatch(model)
    check_length(model.config, args)
    return model.to(args.device).eval(), note


def check_length(config, args) -> None:
    """Prompt plus new tokens must fit the model's positions (GPT-2's table has 1024: past it, an index error)."""
    longest = _positions(config)
    if longest is not None and args.prompt_tokens + args.new_tokens > longest:
        raise RetrofitError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceeds the "
                            f"model's {longest} positions; use a shorter prompt")


def _check_early(args) -> None:
    """What can be refused from the config alone, before the weights load (a GGUF file takes ~15 s)."""
    from ..load import load_config

    try:
        config = load_config(args.model)
    except (RetrofitError, OSError, ValueError):  # an adapter folder, a model without config.json ...
        return  # loading the model reports its own problem, and check_length runs again after it
    check_length(config, args)


def generate(model, prompt, new_tokens: int) -> tuple[float, float, list[int]]:
    """Greedy KV-cache decoding: (prefill seconds, decode seconds for new_tokens steps, the generated ids)."""
    import torch

    sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    with torch.inference_mode():
        sync()
        start = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)  # (1, T, V) logits, the cache filled with T positions
        token = out.logits[:, -1:].argmax(-1)  # (1, 1)
        sync()
        prefilled = time.perf_counter()
        ids = [int(token)]  # one host sync per token, as a chat loop streaming its output would have
        cache = out.past_key_values
        for _ in range(new_tokens):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            ids.append(int(token))
        sync()
        done = time.perf_counter()
    return prefilled - start, done - prefilled, ids


def _arm_options(norm: str, p: float) -> dict:
    """The norm's example options (Norm.example_options), with --p for a norm that has a p."""
    from ..norms import get_norm

    if norm == "unpatched":
        return {}
    options = dict(get_norm(norm).example_options)
    return {**options, "p": p} if "p" in options else options


def measure(model, prompt, arms: list[str], args) -> dict[str, dict]:
    """{arm: {"prefill_s": [...], "decode_s": [...]}}: arms alternate within each repeat, patched and unpatched."""
    from ..patching import patch, unpatch

    times = {arm: {"prefill_s": [], "decode_s": []} for arm in arms}
    warm = set()
    for repeat in range(args.repeats):
        for arm in arms:
            if arm != "unpatched":
                patch(model, arm, **_arm_options(arm, args.p))
            try:
                if arm not in warm:  # pages in the code paths of this arm (threads, kernels) before any timing
                    generate(model, prompt[:, : min(prompt.shape[1], 32)], 2)
                    warm.add(arm)
                prefill, decode, _ = generate(model, prompt, args.new_tokens)
            finally:
                if arm != "unpatched":
                    unpatch(model)
            times[arm]["prefill_s"].append(prefill)
            times[arm]["decode_s"].append(decode)
            print(f"repeat {repeat + 1}/{args.repeats} {arm:10} prefill {prefill:7.3f} s, decode "
                  f"{args.new_tokens / decode:8.2f} tok/s", file=sys.stderr, flush=True)
    return times


def summarize(times: dict[str, dict], new_tokens: int, p: float) -> list[dict]:
    """One row per arm: medians, decode tokens/s and the time-per-token ratio to the unpatched arm vs its target."""
    base = statistics.median(times["unpatched"]["decode_s"]) / new_tokens
    base_prefill = statistics.median(times["unpatched"]["prefill_s"])
    from ..norms import get_norm

    rows = []
    for arm, t in times.items():
        per_token = statistics.median(t["decode_s"]) / new_tokens
        prefill = statistics.median(t["prefill_s"])
        row = {"norm": arm, "options": _arm_options(arm, p), "prefill_s": round(prefill, 4),
               "prefill_ratio": round(prefill / base_prefill, 3), "decode_tokens_per_s": round(1 / per_token, 2),
               "s_per_token": round(per_token, 6), "ratio": round(per_token / base, 3),
               "prefill_s_all": [round(x, 4) for x in t["prefill_s"]],
               "decode_tokens_per_s_all": [round(new_tokens / x, 2) for x in t["decode_s"]]}
        if arm != "unpatched":
            row["target"] = get_norm(arm).decode_target or DEFAULT_TARGET
            row["meets_target"] = per_token / base <= row["target"]
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    from ..evaluate.report import markdown_table

    header = ["norm", "prefill s", "prefill / unpatched", "decode tok/s", "time per token / unpatched", "target",
              "met"]
    return markdown_table(header, [
        [r["norm"] + (f" p={r['options']['p']:g}" if "p" in r["options"] else ""), r["prefill_s"],
         f"{r['prefill_ratio']:.2f}x", r["decode_tokens_per_s"], f"{r['ratio']:.2f}x",
         f"<= {r['target']:.2f}x" if "target" in r else "", {True: "met", False: "missed"}.get(r.get("meets_target"),
                                                                                              "")]
        for r in rows])


def run(args: argparse.Namespace) -> int:
    norms = _norms(args.norms)
    if not args.p > 0:
        raise RetrofitError(f"--p must be > 0; got {args.p}")
    from ..load import source_kind

    source_kind(args.model)  # a missing file or folder: one line, before torch or transformers load
    _check_early(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model, note = _load(args)
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=generator).to(args.device)  # (1, T)
    times = measure(model, prompt, ["unpatched", *norms], args)
    rows = summarize(times, args.new_tokens, args.p)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {
        "benchmark": "decode", "model": str(args.model), "model_type": model.config.model_type,
        "device": str(args.device), "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "load_average": load, "torch": torch.__version__, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "repeats": args.repeats,
        "prompt": f"random token ids from torch.Generator seed {SEED} (decoding speed does not depend on the text)",
        "method": "greedy KV-cache decoding, batch 1: prefill = one forward of the prompt; decode = new_tokens "
                  "one-token forwards; medians over repeats, arms alternating within each repeat",
        "note": note, "results": rows,
    }
    print(f"{args.model}: {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.device}, "
          f"{result['threads']} threads, medians of {args.repeats}" + (f"; {note}" if note else ""))
    print(_table(rows))
    out = out_path(args.out)
    atomic_write_text(out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
