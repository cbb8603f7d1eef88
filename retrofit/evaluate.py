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
import gc
import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import RetrofitError
from .memory import PeakMemory

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


def _bucket_rows(sums: torch.Tensor, per_position: int, key: str, skip_first=False) -> list[dict]:
    """(L,) per-position sums over `per_position` items each -> log-spaced bucket means."""
    buckets = position_buckets(sums.shape[0])[1 if skip_first else 0:]
    return [{"start": a, "end": b, key: sums[a:b].sum().item() / (per_position * (b - a)),
             "tokens": per_position * (b - a)} for a, b in buckets]


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
    """Mean next-token loss, loss by log-spaced position bucket, time and peak memory, for each length.
    documents: token-id lists (one per document), or one flat list / 1-D tensor of token ids."""
    from tqdm.auto import tqdm

    if torch.is_tensor(documents):
        documents = [documents] if documents.ndim == 1 else list(documents)
    elif documents and isinstance(documents[0], int):
        documents = [documents]

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
            "by_position": _bucket_rows(position_sum, n, "loss"),
        })
    return rows


@torch.inference_mode()
def evaluate_passkey(model, tokenizer, lengths: list[int], *, depths=(0.0, 0.25, 0.5, 0.75, 1.0), trials=8,
                     digits=5, seed=0, batch_tokens=16384) -> list[dict]:
    """Greedy retrieval accuracy of data.passkey_batch's key, by length x depth. The model reads L tokens;
    a trial counts when every answer token is the argmax (= greedy decoding of the answer)."""
    from .data import passkey_batch

    device = next(model.parameters()).device
    rows = []
    for length in lengths:
        for depth in depths:
            batch = passkey_batch(tokenizer, trials, length + 1, depth=depth, digits=digits, seed=seed)
            ids, labels = batch["input_ids"].to(device), batch["labels"][:, 1:].to(device)  # (n, L + 1), (n, L)
            hits, step = 0, max(1, batch_tokens // length)
            for i in range(0, trials, step):
                hidden = model.base_model(input_ids=ids[i:i + step, :-1], use_cache=False)[0]  # (b, L, d)
                answer = labels[i:i + step] != -100  # (b, L): only the answer positions go through the head
                wrong = head_logits(model, hidden[answer]).argmax(-1) != labels[i:i + step][answer]
                hits += answer.shape[0] - answer.nonzero()[:, 0][wrong].unique().numel()
            rows.append({"length": length, "depth": float(depth), "accuracy": hits / trials, "trials": trials})
    return rows


@torch.inference_mode()
def evaluate_counting(model, lengths: list[int], *, sequences=8, alphabet=8, seed=0, batch_tokens=16384) -> list[dict]:
    """L1 and MSE of a counting model (input_ids (B, T) -> counts (B, T)) on data.counting_batch sequences
    of T = length tokens, over positions 1..T-1, with L1 by log-spaced position bucket."""
    from .data import counting_batch

    device = next(model.parameters()).device
    rows = []
    for length in lengths:
        batch = counting_batch(sequences, length, alphabet=alphabet, seed=seed)
        l1_sum, sq_sum = torch.zeros(length, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        step = max(1, batch_tokens // length)
        for i in range(0, sequences, step):
            err = model(batch["input_ids"][i:i + step].to(device)).cpu() - batch["counts"][i:i + step]  # (b, T)
            err[:, 0] = 0  # position 0 holds the target symbol: no count to predict
            l1_sum += err.abs().double().sum(0)
            sq_sum += err.double().pow(2).sum()
        n = sequences * (length - 1)
        mean_count = batch["counts"][:, 1:].double().mean().item()  # counts grow with length: L1 relative to this
        rows.append({"length": length, "l1": l1_sum.sum().item() / n, "mse": sq_sum.item() / n, "sequences": sequences,
                     "mean_count": mean_count, "relative_l1": l1_sum.sum().item() / n / max(mean_count, 1e-9),
                     "by_position": _bucket_rows(l1_sum, sequences, "l1", skip_first=True)})
    return rows


# ---- data: text files tokenized once per tokenizer, or pre-tokenized JSON --------------------------------------

def read_token_file(path) -> list[list[int]]:
    """A .json file holding token ids: one list (one document) or a list of lists (documents)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RetrofitError(f"cannot read token file {path}: {err}; give a JSON list of token ids") from None
    documents = data if isinstance(data, list) and data and isinstance(data[0], list) else [data]
    if not all(isinstance(doc, list) and all(isinstance(t, int) for t in doc) for doc in documents):
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
    """A tokenizer object; a model source (its tokenizer, or None); or a tokenizer folder. A bare
    vocab.json + merges.txt folder (no tokenizer_config.json) is read as byte-level BPE, GPT-2 style."""
    if source is None or hasattr(source, "get_vocab") or not isinstance(source, (str, Path)):
        return source if hasattr(source, "get_vocab") else None  # a loaded model carries no tokenizer
    from .models import load_tokenizer
    return load_tokenizer(source)


def model_name(source) -> str:
    if not isinstance(source, (str, Path)):
        return getattr(getattr(source, "config", None), "model_type", type(source).__name__)
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.name or str(source)


# ---- the whole evaluation ------------------------------------------------------------------------------------

def evaluate_models(sources: list, *, data=None, tokens=None, lengths, train_len=None, tasks=None, max_tokens=None,
                    tokenizer=None, names=None, batch_tokens=16384, chunk_tokens=1024, dtype=None, device="cpu",
                    passkey=None, counting=None, progress=True) -> dict:
    """Evaluate every model (a source for `retrofit.train.load_run`, or a loaded model) -> results dict.

    tasks: some of "lm", "passkey", "counting"; None = "counting" for counting runs, "lm" otherwise.
    The lm data: `tokens` (token ids, or a list of documents), or `data` paths (.json token files, or
    text tokenized by `tokenizer`, else each model's own). passkey/counting: keyword dicts for
    evaluate_passkey/evaluate_counting. Schema of the result: docs/results-schema.md.
    """
    lengths = parse_lengths(lengths) if isinstance(lengths, str) else sorted(set(lengths))
    names = list(names) if names else _unique([model_name(s) for s in sources])
    if len(names) != len(sources):
        raise RetrofitError(f"{len(names)} names for {len(sources)} models: give one name per model")
    unknown = set(tasks or ()) - {"lm", "passkey", "counting"}
    if unknown:
        raise RetrofitError(f"unknown tasks {sorted(unknown)}: choose from lm, passkey, counting")
    data = [data] if isinstance(data, (str, Path)) else list(data or [])
    prepared = _prepare_data(sources, data, tokens, tokenizer, lengths, tasks)
    results = {"schema": "retrofit.eval/1", "train_len": train_len, "lengths": lengths,
               "data": {"files": [str(p) for p in data],
                        "documents": [len(d) for d in next((d for _, d, _ in prepared if d), [])]},
               "settings": {"tasks": tasks, "max_tokens": max_tokens, "batch_tokens": batch_tokens,
                            "chunk_tokens": chunk_tokens, "device": str(device), "passkey": passkey,
                            "counting": counting, "window": "L + 1 tokens: read L, predict tokens 1..L"},
               "models": []}
    for source, name, (key, documents, tok) in zip(sources, names, prepared):
        model = _load(source, dtype, device)
        lm, counting_model = _language_model(model)
        wanted = tasks or (["counting"] if counting_model else ["lm"])
        if counting_model != ("counting" in wanted) or (counting_model and len(wanted) > 1):
            raise RetrofitError(f"{name} is {'a counting run' if counting_model else 'a language model'}: "
                                f"evaluate it with --tasks {'counting' if counting_model else 'lm and/or passkey'}")
        if "lm" in wanted and documents is None and not data:
            raise RetrofitError("no data to evaluate on: pass --data FILE (text, or .json token ids)")
        if ("lm" in wanted and documents is None) or ("passkey" in wanted and tok is None):
            raise RetrofitError(f"no tokenizer for {name}: pass --tokenizer PATH (a tokenizer folder)")
        check_lengths(lm, lengths, name)
        entry = {"name": name, "source": str(source) if isinstance(source, (str, Path)) else None,
                 "model_type": lm.config.model_type, "tokenizer": key, "dtype": str(lm.dtype).removeprefix("torch."),
                 "retrofit": getattr(lm.config, "retrofit", None), "max_learned_positions": _position_limit(lm),
                 "max_position_embeddings": _config_value(lm.config, "max_position_embeddings"),
                 "memory_kind": PeakMemory(device).kind, "lengths": []}
        if "lm" in wanted:
            entry["lengths"] = evaluate_lengths(lm, documents, lengths, max_tokens=max_tokens,
                                                batch_tokens=batch_tokens, chunk_tokens=chunk_tokens, name=name,
                                                progress=progress)
        if "passkey" in wanted:
            entry["passkey"] = evaluate_passkey(lm, tok, lengths, batch_tokens=batch_tokens, **(passkey or {}))
        if "counting" in wanted:
            options = {"alphabet": _run_alphabet(source), **(counting or {})}
            entry["counting"] = evaluate_counting(model, lengths, batch_tokens=batch_tokens, **options)
        results["models"].append(entry)
        del model, lm
        gc.collect()
    return results


def _prepare_data(sources, data, tokens, tokenizer, lengths, tasks) -> list[tuple]:
    """(tokenizer fingerprint, documents or None, tokenizer or None) per source. Text is tokenized once
    per distinct tokenizer, and every length is cut now, so bad data fails before any model loads."""
    if tokens is None and data and any(str(p).endswith(".json") for p in data):
        if not all(str(p).endswith(".json") for p in data):
            raise RetrofitError("--data mixes .json token files and text files: give one kind")
        tokens = [doc for path in data for doc in read_token_file(path)]
    if tokens is not None:
        tokens = tokens if tokens and isinstance(tokens[0], (list, tuple)) else [tokens]
    elif not data and tasks and "lm" in tasks:
        raise RetrofitError("no data to evaluate on: pass --data FILE (text, or .json token ids)")
    needs_tokenizer = bool((tokens is None and data) or (tasks and "passkey" in tasks))
    explicit = load_any_tokenizer(tokenizer) if needs_tokenizer and tokenizer is not None else None
    prepared, cache = [], {}
    for source in sources:
        tok = (explicit or load_any_tokenizer(source)) if needs_tokenizer else None
        key = tokenizer_fingerprint(tok) if tok is not None else "given"
        documents = tokens
        if tokens is None and data and tok is not None:
            if key not in cache:
                cache[key] = tokenize_files(tok, data)
            documents = cache[key]
        prepared.append((key, documents, tok))
    if tasks is None or "lm" in tasks:
        for documents in {id(d): d for _, d, _ in prepared if d is not None}.values():
            for length in lengths:
                cut_windows(documents, length, 1)
    return prepared


def _load(source, dtype, device):
    if not isinstance(source, (str, Path)):
        return source.eval()
    from .train.tasks import load_run  # a run folder (LoRA, counting head) or any load_model source
    return load_run(str(source), dtype=dtype).to(device).eval()


def _language_model(model):
    """(the causal LM inside, whether `model` is a counting model: input_ids -> counts)."""
    from .train.tasks import CountingModel, language_model
    return language_model(model), isinstance(model, CountingModel)


def _run_alphabet(source) -> int:
    """The counting alphabet a run trained with (its recipe.yaml), else data.py's default of 8."""
    recipe = Path(str(source)) / "recipe.yaml"
    if isinstance(source, (str, Path)) and recipe.is_file():
        import yaml
        return int(((yaml.safe_load(recipe.read_text()) or {}).get("data", {}).get("counting") or {}).get("alphabet", 8))
    return 8


def _unique(names: list[str]) -> list[str]:
    return [f"{n}-{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


# ---- command line --------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="run folders, patched checkpoints, Hub ids or .gguf files")
    parser.add_argument("--data", nargs="+", default=None,
                        help="text files (one document each) or .json files of token ids (lm task)")
    parser.add_argument("--lengths", default="256,512,...,4096",
                        help="context lengths: 256,512,1024 or a doubling 256,512,...,65536")
    parser.add_argument("--train-len", type=int, default=None, help="the training length, marked in tables and plots")
    parser.add_argument("--out", default="eval", help="folder for results.json/.csv/.md and the plots")
    parser.add_argument("--tasks", default=None,
                        help="comma list of lm, passkey, counting (default: counting for counting runs, else lm)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap on scored tokens per length and model (default: every window)")
    parser.add_argument("--names", default=None, help="comma-separated names for the models, in order")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (or model) to use for every model")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward (windows batched up to this)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="positions per head/loss chunk")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey depths, 0 = start .. 1 = end")
    parser.add_argument("--trials", type=int, default=8, help="passkey trials / counting sequences per length")
    parser.add_argument("--alphabet", type=int, default=None, help="counting alphabet (default: the run's recipe)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from .report import cost_table_markdown, loss_table_markdown, write_report

    try:
        depths = [float(d) for d in args.depths.split(",")]
    except ValueError:
        raise RetrofitError(f"--depths {args.depths!r}: give numbers between 0 and 1, like 0,0.5,1") from None
    counting = {"sequences": args.trials, **({"alphabet": args.alphabet} if args.alphabet else {})}
    results = evaluate_models(
        args.models, data=args.data, lengths=args.lengths, train_len=args.train_len,
        tasks=args.tasks.split(",") if args.tasks else None, max_tokens=args.max_tokens, tokenizer=args.tokenizer,
        names=args.names.split(",") if args.names else None, batch_tokens=args.batch_tokens,
        chunk_tokens=args.chunk_tokens, dtype=args.dtype, device=args.device,
        passkey={"depths": depths, "trials": args.trials}, counting=counting, progress=not args.no_progress)
    paths = write_report(results, args.out)
    if any(m["lengths"] for m in results["models"]):
        print(loss_table_markdown(results) + "\n\n" + cost_table_markdown(results))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
