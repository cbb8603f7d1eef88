"""Scoring: next-token losses computed from the final hidden states in chunks, passkey and counting.

Memory: the model body gives final hidden states (B, L, d); the output head runs on `chunk_tokens`
positions at a time, so peak memory grows with L and never with L x vocab.
"""

from __future__ import annotations

import hashlib
import time

import torch
from tqdm.auto import tqdm

from ..data import counting_batch, passkey_batch
from ..errors import RetrofitError
from ..logit_head import LOGIT_TRANSFORMS, config_value, head_logits, head_token_scores
from ..memory import PeakMemory
from ..positions import position_limit
from .intervals import as_list, mean_interval, proportion_interval
from .tail import tail_buckets, window_tails
from .windows import bucket_rows, cut_windows, stack_windows, window_starts

__all__ = ["LOGIT_TRANSFORMS", "check_head", "check_lengths", "config_value", "evaluate_counting", "evaluate_lengths",
           "evaluate_passkey", "fresh_dynamic_rope", "head_logits", "original_positions", "token_losses"]


def original_positions(model) -> int | None:
    """The positions the model was trained for: a rope patch's original_positions (it raises
    max_position_embeddings), else max_position_embeddings."""
    rope = (config_value(model.config, "retrofit") or {}).get("rope")
    return rope["original_positions"] if rope else config_value(model.config, "max_position_embeddings")


def fresh_dynamic_rope(model) -> int:
    """Put every dynamic-NTK rotary module back to its state before any call; returns how many.

    transformers' `dynamic_rope_update` recomputes inv_freq only for a call longer than every earlier one (and
    resets only for a call within the original length), so a window of length L evaluated after a longer one
    would use the longer one's frequencies. Called before each length, every length is scored as a fresh model
    scores it: results do not depend on which lengths came before, or in which order."""
    reset = 0
    for module in model.modules():
        rope_types = getattr(module, "rope_type", None)
        if not hasattr(module, "original_max_seq_len") or rope_types is None:
            continue
        by_layer = rope_types if isinstance(rope_types, dict) else {None: rope_types}
        for layer_type, rope_type in by_layer.items():
            if "dynamic" not in str(rope_type):
                continue
            prefix = f"{layer_type}_" if layer_type else ""
            original = getattr(module, f"{prefix}original_inv_freq")
            module.register_buffer(f"{prefix}inv_freq", original.clone(), persistent=False)
            setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)
            reset += 1
    return reset


@torch.inference_mode()
def token_losses(model, windows: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """(B, L + 1) windows -> (B, L) float32 next-token losses, running the head chunk by chunk."""
    inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, L), (B, L)
    hidden = model.base_model(input_ids=inputs, use_cache=False)[0]  # (B, L, d)
    return head_token_scores(model, hidden, targets, chunk_tokens, hits=False)[0]  # the head chunk by chunk


@torch.inference_mode()
def check_head(model, ids: torch.Tensor) -> None:
    """Refuse models whose forward makes logits differently from body + head (+ LOGIT_TRANSFORMS)."""
    ids = ids[:, :32]
    ours = head_logits(model, model.base_model(input_ids=ids, use_cache=False)[0])
    theirs = model(input_ids=ids, use_cache=False).logits.float()
    tol = 1e-3 if ours.dtype == torch.float32 and model.dtype == torch.float32 else 5e-2
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=tol * (1 + theirs.abs().max().item())):
        raise RetrofitError(f"{type(model).__name__} makes its logits in a way `retrofit eval` does not know "
                            "(see LOGIT_TRANSFORMS in retrofit/logit_head.py): add its transform there")


def check_lengths(model, lengths, name="model") -> None:
    """A length beyond learned absolute positions is an error naming the limit and the ways out."""
    limit = position_limit(model)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise RetrofitError(f"{name} has learned positions for {limit} tokens only, so lengths {too_long} cannot be "
                            f"evaluated: use --lengths up to {limit}, or patch it with --nope "
                            "(`retrofit patch MODEL --norm NORM --nope`) to remove positions")


def evaluate_lengths(model, documents: list, lengths: list[int], *, max_tokens=None, max_windows=None,
                     batch_tokens=16384, chunk_tokens=1024, name="model", progress=True) -> list[dict]:
    """Mean next-token loss, loss by log-spaced position bucket, time and peak memory, for each length.
    documents: token-id lists (one per document), or one flat list / 1-D tensor of token ids."""

    if torch.is_tensor(documents):
        documents = [documents] if documents.ndim == 1 else list(documents)
    elif documents and isinstance(documents[0], int):
        documents = [documents]

    check_lengths(model, lengths, name)
    device = next(model.parameters()).device
    max_positions = original_positions(model)
    check_head(model, cut_windows(documents, min(lengths), 1)[:, :-1].to(device))
    rows = []
    for length in lengths:
        fresh_dynamic_rope(model)
        starts = window_starts(documents, length, max_tokens, max_windows)
        windows = stack_windows(documents, starts, length)  # (N, L + 1)
        row = _length_row(model, windows, length, batch_tokens, chunk_tokens, name, progress, device)
        window_documents = [d for d, _ in starts]
        row |= {"beyond_max_positions": bool(max_positions and length > max_positions),
                "window_documents": window_documents,
                "windows_by_document": [window_documents.count(d) for d in range(len(documents))],
                "ci95": as_list(mean_interval(row["window_losses"]))}
        rows.append(row)
        if not progress:  # no bar: one line as each length finishes, so a redirected run is never silent (issue 62)
            print(length_line(name, row), flush=True)
    return rows


def length_line(name: str, row: dict) -> str:
    """`tiny L=64: loss 4.5812 ± 0.0213 (12 windows, 3.1 s)`: one evaluated length (± the 95% interval's half)."""
    ci = row.get("ci95")
    spread = f" ± {(ci[1] - ci[0]) / 2:.4f}" if ci else ""
    return (f"{name} L={row['length']}: loss {row['loss']:.4f}{spread} ({row['windows']} windows, "
            f"{row['time_s']:.1f} s)")


def _length_row(model, windows, length, batch_tokens, chunk_tokens, name, progress, device) -> dict:
    """Score the (N, L + 1) windows: mean loss, each window's mean loss and its means over the last two position
    buckets (the AVnorm post's metric, retrofit.evaluate.tail), loss by position, time and memory."""
    batch = max(1, batch_tokens // length)
    position_sum = torch.zeros(length, dtype=torch.float64)  # summed over windows
    window_sums, tails = [], []  # (b,) and (b, 2) per batch: each window's summed loss, its last two buckets' means
    bar = tqdm(total=windows.shape[0] * length, unit="tok", unit_scale=True, desc=f"{name} L={length}",
               disable=not progress, leave=True, dynamic_ncols=True)
    started = time.perf_counter()
    with PeakMemory(device) as memory:
        for i in range(0, windows.shape[0], batch):
            losses = token_losses(model, windows[i:i + batch].to(device), chunk_tokens).double().cpu()  # (b, L)
            position_sum += losses.sum(0)
            window_sums.append(losses.sum(1))
            tails.append(window_tails(losses))
            bar.update(losses.numel())
            bar.set_postfix(loss=f"{position_sum.sum().item() / (bar.n or 1):.3f}")
    seconds = time.perf_counter() - started
    bar.close()
    n = windows.shape[0]
    return {"length": length, "loss": position_sum.sum().item() / (n * length), "windows": n,
            "tokens": n * length, "time_s": round(seconds, 3), "tokens_per_s": round(n * length / seconds, 1),
            "peak_memory_mb": round(memory.peak_mb, 1), "start_memory_mb": round(memory.start_mb, 1),
            "windows_sha1": hashlib.sha1(windows.numpy().tobytes()).hexdigest(),
            "by_position": bucket_rows(position_sum, n, "loss"),
            "window_losses": (torch.cat(window_sums) / length).tolist(),
            "tail_buckets": tail_buckets(length), "window_tails": torch.cat(tails).tolist()}


@torch.inference_mode()
def evaluate_passkey(model, tokenizer, lengths: list[int], *, depths=(0.0, 0.25, 0.5, 0.75, 1.0), trials=8,
                     digits=5, seed=0, batch_tokens=16384) -> list[dict]:
    """Greedy retrieval accuracy of data.passkey_batch's key, by length x depth. The model reads L tokens;
    a trial counts when every answer token is the argmax (= greedy decoding of the answer)."""

    device = next(model.parameters()).device
    rows = []
    for length in lengths:
        fresh_dynamic_rope(model)
        for depth in depths:
            batch = passkey_batch(tokenizer, trials, length + 1, depth=depth, digits=digits, seed=seed)
            ids, labels = batch["input_ids"].to(device), batch["labels"][:, 1:].to(device)  # (n, L + 1), (n, L)
            hits, step = 0, max(1, batch_tokens // length)
            for i in range(0, trials, step):
                hidden = model.base_model(input_ids=ids[i:i + step, :-1], use_cache=False)[0]  # (b, L, d)
                answer = labels[i:i + step] != -100  # (b, L): only the answer positions go through the head
                wrong = head_logits(model, hidden[answer]).argmax(-1) != labels[i:i + step][answer]
                hits += answer.shape[0] - answer.nonzero()[:, 0][wrong].unique().numel()
            rows.append({"length": length, "depth": float(depth), "accuracy": hits / trials, "trials": trials,
                         "correct": hits, "ci95": as_list(proportion_interval(hits, trials))})
    return rows


@torch.inference_mode()
def evaluate_counting(model, lengths: list[int], *, sequences=8, alphabet=8, seed=0, batch_tokens=16384,
                      prefixes=False) -> list[dict]:
    """L1 and MSE of a counting model (input_ids (B, T) -> counts (B, T)) on data.counting_batch sequences
    of T = length tokens, over positions 1..T-1, with L1 by log-spaced position bucket.

    prefixes=True scores every length as a prefix of the same `sequences` sequences of the longest length (the L2
    post's evaluation: one forward at the longest length, scored at every prefix boundary): a causal model's
    prediction at position t sees only positions <= t, so the prefix of length L is scored as a sequence of length
    L would be (other draws of the same distribution), at the cost of one forward instead of one per length."""
    if prefixes:
        longest = max(lengths)
        errors, counts = _counting_errors(model, sequences, longest, alphabet, seed, batch_tokens)
        return [_counting_row(errors[:, :n], counts[:, :n]) | {"prefix_of": longest} for n in lengths]
    rows = []
    for length in lengths:
        rows.append(_counting_row(*_counting_errors(model, sequences, length, alphabet, seed, batch_tokens)))
    return rows


def _counting_errors(model, sequences: int, length: int, alphabet: int, seed: int, batch_tokens: int):
    """(predicted - true count, true count), both (sequences, length) float64; position 0 (the target symbol, no
    count to predict) has error 0."""
    device = next(model.parameters()).device
    fresh_dynamic_rope(model)
    batch = counting_batch(sequences, length, alphabet=alphabet, seed=seed)
    step, errors = max(1, batch_tokens // length), []
    for i in range(0, sequences, step):
        err = model(batch["input_ids"][i:i + step].to(device)).cpu() - batch["counts"][i:i + step]  # (b, T)
        err[:, 0] = 0
        errors.append(err.double())
    return torch.cat(errors), batch["counts"].double()


def _counting_row(errors: torch.Tensor, counts: torch.Tensor) -> dict:
    """One evaluation row from (sequences, L) errors and true counts: L1, MSE, per-sequence L1 (the units of the
    interval), L1 relative to the mean true count, and L1 by position bucket."""
    sequences, length = errors.shape
    n = sequences * (length - 1)
    l1_by_position = errors.abs().sum(0)  # (L,)
    per_sequence = errors.abs().sum(1) / (length - 1)  # (S,): each sequence's mean |error| over positions 1..L-1
    mean_count = counts[:, 1:].mean().item()  # counts grow with length: L1 relative to this
    l1 = l1_by_position.sum().item() / n
    return {"length": length, "l1": l1, "mse": errors.pow(2).sum().item() / n, "sequences": sequences,
            "sequence_l1": per_sequence.tolist(), "ci95": as_list(mean_interval(per_sequence.numpy())),
            "mean_count": mean_count, "relative_l1": l1 / max(mean_count, 1e-9),
            "by_position": bucket_rows(l1_by_position, sequences, "l1", skip_first=True)}


