"""Length extrapolation: loss by context length and by position, passkey retrieval, counting.

    retrofit eval runs/base runs/avnorm --data persuasion.txt --lengths 256,512,...,65536 \
        --train-len 1024 --max-tokens 65536 --out eval/

A window of length L is L + 1 consecutive tokens of one document: the model reads the first L and
is scored on predicting tokens 1..L, so the last prediction has seen exactly L tokens. Windows are
cut without overlap from the start of each document; `max_tokens` keeps an evenly spaced subset.
They depend only on the tokens, so every model with the same tokenizer sees the same windows.

Memory: the model body gives final hidden states (B, L, d); the output head runs on `chunk_tokens`
positions at a time, so peak memory grows with L and never with L x vocab.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import math
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import RetrofitError

# Families whose CausalLM head transforms logits after the output projection, keyed by the config
# attribute that turns it on. `check_head` catches any family missing from this table.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": lambda x, cap: torch.tanh(x / cap) * cap,  # gemma2/3/4
    "logit_scale": lambda x, scale: x * scale,  # cohere
    "logits_scaling": lambda x, scale: x / scale,  # granite
}


def parse_lengths(text: str) -> list[int]:
    """'256,512,...,4096' -> [256, 512, 1024, 2048, 4096]: `a,b,...,c` continues the ratio b/a up to c."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        if "..." in parts:
            i = parts.index("...")
            if i < 2 or i != len(parts) - 2:
                raise ValueError
            head, last = [int(p) for p in parts[:i]], int(parts[-1])
            ratio = head[-1] // head[-2]
            if ratio < 2 or head[-1] != head[-2] * ratio:
                raise ValueError
            while head[-1] < last:
                head.append(head[-1] * ratio)
            if head[-1] != last:
                raise ValueError
            lengths = head
        else:
            lengths = [int(p) for p in parts]
    except ValueError:
        raise RetrofitError(f"cannot read lengths {text!r}: write a comma list like 256,512,1024 "
                            "or a doubling like 256,512,...,65536 (the last length must lie on the sequence)") from None
    if not lengths or min(lengths) < 2:
        raise RetrofitError(f"lengths {text!r}: give at least one length, each at least 2 tokens")
    return sorted(set(lengths))


def cut_windows(documents: list, length: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping (N, length + 1) windows from the documents; an evenly spaced N when capped."""
    starts = [(d, s) for d, doc in enumerate(documents) for s in range(0, len(doc) - length, length + 1)]
    if not starts:
        longest = max((len(doc) for doc in documents), default=0)
        raise RetrofitError(f"length {length} needs {length + 1} tokens in one document but the longest has "
                            f"{longest}: use shorter --lengths or longer --data")
    keep = len(starts) if not max_tokens else max(1, min(len(starts), max_tokens // length))
    chosen = [starts[i * len(starts) // keep] for i in range(keep)]
    return torch.stack([torch.as_tensor(documents[d][s:s + length + 1], dtype=torch.long) for d, s in chosen])


def position_buckets(length: int) -> list[tuple[int, int]]:
    """Log-spaced [start, end) position buckets: [0,1), [1,2), [2,4), [4,8), ... up to length."""
    edges = [0] + [2 ** k for k in range(math.ceil(math.log2(length)) + 1) if 2 ** k < length] + [length]
    return list(zip(edges[:-1], edges[1:]))


def _config_value(config, name):
    value = getattr(config, name, None)
    if value is None and getattr(config, "text_config", None) is not None:
        value = getattr(config.text_config, name, None)
    return value


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, d) final hidden states -> (B, T, V) float32 logits, as the model's own forward makes them."""
    logits = model.get_output_embeddings()(hidden).float()
    for name, transform in LOGIT_TRANSFORMS.items():
        value = _config_value(model.config, name)
        if value is not None and not isinstance(value, bool):
            logits = transform(logits, float(value))
    return logits


@torch.inference_mode()
def token_losses(model, windows: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """(B, L + 1) windows -> (B, L) float32 next-token losses, running the head chunk by chunk."""
    inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, L), (B, L)
    hidden = model.base_model(input_ids=inputs, use_cache=False)[0]  # (B, L, d)
    B, L = targets.shape
    losses = torch.empty(B, L, dtype=torch.float32, device=windows.device)
    step = max(1, chunk_tokens // B)
    for s in range(0, L, step):
        logits = head_logits(model, hidden[:, s:s + step])  # (B, c, V): the only vocab-sized tensor
        losses[:, s:s + step] = F.cross_entropy(logits.flatten(0, 1), targets[:, s:s + step].flatten(),
                                                reduction="none").view(B, -1)
    return losses


@torch.inference_mode()
def check_head(model, ids: torch.Tensor) -> None:
    """Refuse models whose forward makes logits differently from body + head (+ LOGIT_TRANSFORMS)."""
    ids = ids[:, :32]
    ours = head_logits(model, model.base_model(input_ids=ids, use_cache=False)[0])
    theirs = model(input_ids=ids, use_cache=False).logits.float()
    tol = 1e-3 if ours.dtype == torch.float32 and model.dtype == torch.float32 else 5e-2
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=tol * (1 + theirs.abs().max().item())):
        raise RetrofitError(f"{type(model).__name__} makes its logits in a way `retrofit eval` does not know "
                            "(see LOGIT_TRANSFORMS in retrofit/evaluate.py): add its transform there")


class PeakMemory:
    """Peak memory (MiB) while the block runs: the CUDA allocator's peak, else process RSS sampled every 10 ms."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.kind = "cuda_allocated" if self.cuda else "rss"
        self.start_mb = self.peak_mb = 0.0

    @staticmethod
    def rss_mb() -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * (4096 / 2 ** 20)
        except OSError:  # not Linux: psutil ships with accelerate
            import psutil
            return psutil.Process().memory_info().rss / 2 ** 20

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak_mb = max(self.peak_mb, self.rss_mb())

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.start_mb = torch.cuda.memory_allocated() / 2 ** 20
            return self
        gc.collect()
        try:  # hand freed heap back to the OS, so one length's peak does not leak into the next
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        self.start_mb = self.peak_mb = self.rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.peak_mb = torch.cuda.max_memory_allocated() / 2 ** 20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, self.rss_mb())


def _position_limit(model) -> int | None:
    from .models import max_learned_positions
    return max_learned_positions(model)


def check_lengths(model, lengths, name="model") -> None:
    """A length beyond learned absolute positions is an error naming the limit and the ways out."""
    limit = _position_limit(model)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise RetrofitError(f"{name} has learned positions for {limit} tokens only, so lengths {too_long} cannot be "
                            f"evaluated: use --lengths up to {limit}, or patch it with --nope "
                            "(`retrofit patch MODEL --norm NORM --nope`) to remove positions")


def evaluate_lengths(model, documents: list, lengths: list[int], *, max_tokens=None, batch_tokens=16384,
                     chunk_tokens=1024, name="model", progress=True) -> list[dict]:
    """Mean next-token loss, loss by log-spaced position bucket, time and peak memory, for each length."""
    from tqdm.auto import tqdm

    check_lengths(model, lengths, name)
    device = next(model.parameters()).device
    max_positions = _config_value(model.config, "max_position_embeddings")
    check_head(model, cut_windows(documents, min(lengths), 1)[:, :-1].to(device))
    rows = []
    for length in lengths:
        windows = cut_windows(documents, length, max_tokens)  # (N, L + 1)
        batch = max(1, batch_tokens // length)
        position_sum = torch.zeros(length, dtype=torch.float64)  # summed over windows
        bar = tqdm(total=windows.shape[0] * length, unit="tok", unit_scale=True, desc=f"{name} L={length}",
                   disable=not progress, leave=True, dynamic_ncols=True)
        started = time.perf_counter()
        with PeakMemory(device) as memory:
            for i in range(0, windows.shape[0], batch):
                losses = token_losses(model, windows[i:i + batch].to(device), chunk_tokens)  # (b, L)
                position_sum += losses.double().sum(0).cpu()
                bar.update(losses.numel())
                bar.set_postfix(loss=f"{position_sum.sum().item() / (bar.n or 1):.3f}")
        seconds = time.perf_counter() - started
        bar.close()
        n = windows.shape[0]
        rows.append({
            "length": length, "loss": position_sum.sum().item() / (n * length), "windows": n,
            "tokens": n * length, "time_s": round(seconds, 3), "tokens_per_s": round(n * length / seconds, 1),
            "peak_memory_mb": round(memory.peak_mb, 1), "start_memory_mb": round(memory.start_mb, 1),
            "beyond_max_positions": bool(max_positions and length > max_positions),
            "windows_sha1": hashlib.sha1(windows.numpy().tobytes()).hexdigest(),
            "by_position": [{"start": a, "end": b, "loss": position_sum[a:b].sum().item() / (n * (b - a)),
                             "tokens": n * (b - a)} for a, b in position_buckets(length)],
        })
    return rows


# ---- data: text files tokenized once per tokenizer, or pre-tokenized JSON --------------------------------------

def read_token_file(path) -> list[list[int]]:
    """A .json file holding token ids: one list (one document) or a list of lists (documents)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RetrofitError(f"cannot read token file {path}: {err}; give a JSON list of token ids") from None
    documents = data if data and isinstance(data[0], list) else [data]
    if not all(isinstance(t, int) for doc in documents for t in doc):
        raise RetrofitError(f"{path} must hold a JSON list of token ids or a list of such lists")
    return documents


def tokenizer_fingerprint(tokenizer) -> str:
    """Models whose tokenizers share this fingerprint share their tokenized data and windows."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(json.dumps([type(tokenizer).__name__, vocab]).encode()).hexdigest()[:12]


def tokenize_files(tokenizer, paths) -> list[list[int]]:
    """Each text file is one document, tokenized without special tokens."""
    from transformers.utils import logging

    documents = []
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "sequence length is longer than the model's maximum": windows handle that
    try:
        for path in paths:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise RetrofitError(f"cannot read --data {path}: {err}") from None
            documents.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    finally:
        logging.set_verbosity(verbosity)
    return documents


def load_any_tokenizer(source):
    """A tokenizer object, a tokenizer folder, or a model source whose tokenizer `retrofit.models` finds."""
    if source is None or hasattr(source, "get_vocab"):
        return source
    from .models import load_tokenizer
    return load_tokenizer(source)


def model_name(source) -> str:
    if not isinstance(source, (str, Path)):
        return getattr(getattr(source, "config", None), "model_type", type(source).__name__)
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.name or str(source)


# ---- the whole evaluation ------------------------------------------------------------------------------------

def run_eval(sources: list, *, data=None, tokens=None, lengths, train_len=None, max_tokens=None, tokenizer=None,
             names=None, batch_tokens=16384, chunk_tokens=1024, dtype=None, device="cpu",
             progress=True) -> dict:
    """Evaluate every model (a source for `retrofit.models.load_model`, or a loaded model) -> results dict.

    The data: `tokens` (token ids or a list of documents), or `data` paths (.json token files, or text
    files tokenized by `tokenizer` or else each model's own tokenizer). Schema: docs/results-schema.md.
    """
    lengths = parse_lengths(lengths) if isinstance(lengths, str) else sorted(set(lengths))
    names = list(names) if names else _unique([model_name(s) for s in sources])
    if len(names) != len(sources):
        raise RetrofitError(f"{len(names)} names for {len(sources)} models: give one name per model")
    data = [data] if isinstance(data, (str, Path)) else list(data or [])
    if tokens is not None:
        tokens = tokens if tokens and isinstance(tokens[0], (list, tuple)) else [tokens]
    elif data and all(str(p).endswith(".json") for p in data):
        tokens = [doc for path in data for doc in read_token_file(path)]
    elif not data:
        raise RetrofitError("no data to evaluate on: pass --data FILE (text, or .json token ids)")

    # Tokenize once per distinct tokenizer, and cut every length now, so bad data fails before any model loads.
    documents_by_source, cache = [], {}
    for source, name in zip(sources, names):
        if tokens is not None:
            documents_by_source.append(("given", tokens))
            continue
        tok = load_any_tokenizer(tokenizer if tokenizer is not None else source)
        if tok is None:
            raise RetrofitError(f"no tokenizer found for {name}: pass --tokenizer PATH (a tokenizer folder)")
        key = tokenizer_fingerprint(tok)
        if key not in cache:
            cache[key] = tokenize_files(tok, data)
        documents_by_source.append((key, cache[key]))
    for _, documents in {key: docs for key, docs in documents_by_source}.items():
        for length in lengths:
            cut_windows(documents, length, 1)

    results = {"schema": "retrofit.eval/1", "train_len": train_len, "lengths": lengths,
               "data": {"files": [str(p) for p in data], "documents": [len(d) for d in documents_by_source[0][1]]},
               "settings": {"max_tokens": max_tokens, "batch_tokens": batch_tokens, "chunk_tokens": chunk_tokens,
                            "device": str(device), "window": "L + 1 tokens: read L, predict tokens 1..L"},
               "models": []}
    for source, name, (key, documents) in zip(sources, names, documents_by_source):
        model = _load(source, dtype, device)
        entry = {"name": name, "source": str(source) if isinstance(source, (str, Path)) else None,
                 "model_type": model.config.model_type, "tokenizer": key,
                 "dtype": str(model.dtype).removeprefix("torch."),
                 "retrofit": getattr(model.config, "retrofit", None),
                 "max_learned_positions": _position_limit(model),
                 "max_position_embeddings": _config_value(model.config, "max_position_embeddings"),
                 "memory_kind": PeakMemory(device).kind}
        entry["lengths"] = evaluate_lengths(model, documents, lengths, max_tokens=max_tokens,
                                            batch_tokens=batch_tokens, chunk_tokens=chunk_tokens,
                                            name=name, progress=progress)
        results["models"].append(entry)
        del model
        gc.collect()
    return results


def _load(source, dtype, device):
    if not isinstance(source, (str, Path)):
        return source.eval()
    from .models import load_model
    return load_model(str(source), dtype=dtype).to(device).eval()


def _unique(names: list[str]) -> list[str]:
    return [f"{n}-{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


# ---- command line --------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="run folders, patched checkpoints, Hub ids or .gguf files")
    parser.add_argument("--data", nargs="+", required=True,
                        help="text files (one document each) or .json files of token ids")
    parser.add_argument("--lengths", default="256,512,...,4096",
                        help="context lengths: 256,512,1024 or a doubling 256,512,...,65536")
    parser.add_argument("--train-len", type=int, default=None, help="the training length, marked in tables and plots")
    parser.add_argument("--out", default="eval", help="folder for results.json/.csv/.md and the plots")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap on scored tokens per length and model (default: every window)")
    parser.add_argument("--names", default=None, help="comma-separated names for the models, in order")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder to use for every model")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward (windows batched up to this)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="positions per head/loss chunk")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from .report import write_report, loss_table_markdown

    dtype = getattr(torch, args.dtype) if args.dtype else None
    results = run_eval(args.models, data=args.data, lengths=args.lengths, train_len=args.train_len,
                       max_tokens=args.max_tokens, tokenizer=args.tokenizer,
                       names=args.names.split(",") if args.names else None, batch_tokens=args.batch_tokens,
                       chunk_tokens=args.chunk_tokens, dtype=dtype, device=args.device,
                       progress=not args.no_progress)
    paths = write_report(results, args.out)
    print(loss_table_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
