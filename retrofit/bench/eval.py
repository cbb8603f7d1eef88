"""`retrofit bench eval`: time and peak memory of scoring one long window, chunked head vs naive full logits.

    retrofit bench eval                                   # one 16K window, a small random Llama, both methods
    retrofit bench eval --model SmolLM2-135M-Instruct.Q4_1.gguf --length 8192 --out bench-eval.json

chunked: `retrofit.evaluate.token_losses` (model body, then the head on `--chunk-tokens` positions at
a time); naive: `model(ids).logits` (L x vocab floats) and one cross-entropy. Each configuration runs
in a fresh subprocess, so its peak memory is its own. CPU: peak RSS sampled during the scoring
(`start` = RSS with the model loaded); CUDA: the allocator's peak. The default model is built from a
config (no download): Llama layout, hidden 256, 4 layers, 4 heads, GPT-2's vocabulary of 50257, RoPE.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ..errors import RetrofitError
from ..io.atomic import atomic_write_text

METHODS = ("chunked", "naive")
SMALL = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=50257, max_position_embeddings=2048, tie_word_embeddings=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model source for retrofit.load.load "
                        "(default: a small random Llama with GPT-2's vocabulary, built offline)")
    parser.add_argument("--length", type=int, default=16384, help="window length in tokens")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list of: " + ", ".join(METHODS))
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="positions per head chunk (chunked)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per configuration")
    parser.add_argument("--out", default="bench-eval.json", help="where to write the JSON results")


def _model(source):
    if source is None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        sizes = dict(SMALL)
        config = AutoConfig.for_model(sizes.pop("model_type"), **sizes)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", trust_remote_code=False).eval()
    from ..load import load
    return load(source, task_head=False)


def measure(config: dict) -> dict:
    """One configuration, in this process: load, warm up on 128 tokens, then score one window once."""
    import torch
    import torch.nn.functional as F

    from ..evaluate.scoring import token_losses
    from ..memory import PeakMemory

    model = _model(config["model"]).to(config["device"])
    vocab = model.get_output_embeddings().weight.shape[0]
    window = torch.randint(0, vocab, (1, config["length"] + 1), generator=torch.Generator().manual_seed(0))
    window = window.to(config["device"])  # (1, L + 1)

    def score(w):
        if config["method"] == "chunked":
            return token_losses(model, w, config["chunk_tokens"]).mean()
        with torch.inference_mode():
            logits = model(input_ids=w[:, :-1], use_cache=False).logits  # (1, L, V): L x vocab floats
            return F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())

    score(window[:, :129])
    started = time.perf_counter()
    with PeakMemory(config["device"]) as memory:
        loss = float(score(window))
    seconds = time.perf_counter() - started
    return {**config, "model": config["model"] or "small-random-llama", "model_type": model.config.model_type,
            "vocab_size": vocab, "loss": round(loss, 6), "time_s": round(seconds, 2),
            "tokens_per_s": round(config["length"] / seconds, 1), "memory_kind": memory.method,
            "start_memory_mb": round(memory.start_mb), "peak_memory_mb": round(memory.peak_mb),
            "added_memory_mb": round(memory.added_mb),
            "logits_mb": round(config["length"] * vocab * 4 / 2 ** 20)}


def run(args: argparse.Namespace) -> int:
    from ..evaluate.report import markdown_table

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown or not methods:
        raise RetrofitError(f"unknown --methods {sorted(unknown)}: choose from {', '.join(METHODS)}")
    if args.model is not None:
        from ..load import source_kind
        source_kind(args.model)  # a missing file or folder fails here, once, not in every subprocess
    rows = []
    for method in methods:
        config = {"model": args.model, "method": method, "length": args.length, "chunk_tokens": args.chunk_tokens,
                  "device": args.device}
        print(f"bench eval: {method}, length {args.length} (fresh process) ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run([sys.executable, "-m", "retrofit.bench.eval", json.dumps(config)],
                                  capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            raise RetrofitError(f"{method} took over --timeout {args.timeout} s: use a shorter --length") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            rows.append({**config, "error": last})  # e.g. killed for memory: a result, not a crash
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    header = ["method", "length", "time (s)", "tokens/s", "peak memory (MiB)", "added (MiB)", "L x V logits (MiB)",
              "loss"]
    table = markdown_table(header, [[r["method"], r["length"], r.get("time_s"), r.get("tokens_per_s"),
                                     r.get("peak_memory_mb"), r.get("added_memory_mb"), r.get("logits_mb"),
                                     r.get("loss", r.get("error"))] for r in rows])
    print(f"model: {rows[0].get('model') or 'small-random-llama'}, memory: {rows[0].get('memory_kind', '?')}")
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"benchmark": "eval", "results": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":  # the worker: `python -m retrofit.bench.eval CONFIG_JSON` prints one JSON line
    print(json.dumps(measure(json.loads(sys.argv[1]))))
