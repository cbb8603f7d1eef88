"""Zero-shot cost of a patch per layer and per head, so a user can choose `layers=` / `heads=`.

    costs = layer_costs(model, ids)      # model patched (and calibrated) as it will be used; ids (1, T)
    costs = head_costs(model, ids)       # per-head norms (avnorm, ssmax, softmax1)
    print(describe_costs(costs, "layer", baseline))

The cost of layer i is the next-token loss on `ids` with only layer i's norm acting, minus the original model's
loss; of head h, with only head h acting in every patched layer (heads= selects the same heads in every selected
layer). One forward per layer or head, on the norms the model already carries — their calibrated gains and
options as patched — by masking heads (Norm.keep_unselected): a norm whose mask selects no head is, bitwise, the
original attention, exactly as if that layer were left out by `layers=`. The caller caps the tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .attention_modules import attention_modules
from .errors import RetrofitError
from .norms.base import CHILD, Norm


@dataclass(frozen=True)
class Cost:
    index: int   # layer index (model order) or head index
    loss: float  # next-token loss with only this one acting
    cost: float  # loss - the original model's loss


def _norms(model) -> list[tuple[int, Norm]]:
    """(layer index, norm) of every patched attention module, in model order."""
    found = [(i, m._modules[CHILD]) for i, (_, m) in enumerate(attention_modules(model)) if CHILD in m._modules]
    if not found or not all(isinstance(norm, Norm) for _, norm in found):
        raise RetrofitError("ranking layers and heads needs a model patched by retrofit.patch (no PEFT wrapper)")
    return found


@contextlib.contextmanager
def _masks(norms: list[Norm]):
    """Restore every norm's own head mask on exit."""
    saved = [norm.head_mask for norm in norms]
    try:
        yield
    finally:
        for norm, mask in zip(norms, saved):
            norm.head_mask = mask


def _mask(norm: Norm, heads) -> torch.Tensor:
    """(H,) bool on the CPU (keep_unselected moves it to the output's device)."""
    mask = torch.zeros(norm.shape.num_heads, dtype=torch.bool)
    mask[list(heads)] = True
    return mask


@torch.no_grad()
def text_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token loss of `model` on token ids: one sequence (T,) or a batch (B, T)."""
    ids = ids[None] if ids.dim() == 1 else ids
    return float(model(input_ids=ids, labels=ids, use_cache=False).loss)


def _own_heads(norm: Norm) -> list[int]:
    """The heads this norm acts on as patched (its heads= selection, or all)."""
    if norm.head_mask is None:
        return list(range(norm.shape.num_heads))
    return [int(h) for h in norm.head_mask.nonzero().flatten()]


@torch.no_grad()
def selection_loss(model, ids: torch.Tensor, layers: list[int] | None, heads: list[int] | None = None) -> float:
    """The loss with only `layers` (indices among the patched ones; None = all) acting, on `heads` (None = each
    norm's own selection); the norms' masks are restored after."""
    norms = _norms(model)
    with _masks([n for _, n in norms]):
        for index, norm in norms:
            acting = layers is None or index in layers
            norm.head_mask = _mask(norm, (heads if heads is not None else _own_heads(norm)) if acting else ())
        return text_loss(model, ids)


def _bar(items, what: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"rank {what}s", unit="forward", disable=not progress, leave=False)


def layer_costs(model, ids: torch.Tensor, progress: bool = False) -> tuple[float, list[Cost]]:
    """(the loss with no norm acting, the cost of each patched layer alone), cheapest first. No norm acting is the
    original model unless the patch also changed positions (rope=, nope), which stay on for every forward.
    One forward for the baseline and one per patched layer (a progress bar with `progress`)."""
    baseline = selection_loss(model, ids, [])
    costs = []
    for index, _ in _bar(_norms(model), "layer", progress):
        loss = selection_loss(model, ids, [index])
        costs.append(Cost(index, loss, loss - baseline))
    return baseline, sorted(costs, key=lambda c: (c.cost, c.index))


def head_costs(model, ids: torch.Tensor, progress: bool = False) -> tuple[float, list[Cost]]:
    """(the loss with no norm acting, the cost of each head alone in every patched layer), cheapest first.
    One forward for the baseline and one per query head."""
    norms = _norms(model)
    if not type(norms[0][1]).per_head:
        raise RetrofitError(f"{norms[0][1].name} acts on every head alike: its heads cannot be ranked")
    baseline = selection_loss(model, ids, [])
    heads = sorted(set().union(*(_own_heads(n) for _, n in norms)))
    costs = []
    for head in _bar(heads, "head", progress):
        loss = selection_loss(model, ids, None, [head])
        costs.append(Cost(head, loss, loss - baseline))
    return baseline, sorted(costs, key=lambda c: (c.cost, c.index))


def describe_costs(costs: list[Cost], what: str, baseline: float) -> str:
    """The ranking table, cheapest first (what: 'layer' or 'head')."""
    lines = [f"zero-shot cost per {what} (loss with only that {what} patched - {baseline:.4f} with none), "
             "cheapest first:", f"  {what:>5}  {'loss':>8}  {'cost':>8}"]
    lines += [f"  {c.index:>5}  {c.loss:>8.4f}  {c.cost:>+8.4f}" for c in costs]
    return "\n".join(lines)


def suggest(costs: list[Cost], k: int) -> list[int]:
    """The k cheapest indices, sorted (what `--layers` / `--heads` takes, via describe_selection)."""
    return sorted(c.index for c in costs[:k])


def rank_and_suggest(model, ids: torch.Tensor, k: int | None = None, *, progress: bool = True,
                     forward_s: float | None = None, say=print) -> None:
    """Rank the patched layers (then heads, for per-head norms) by their zero-shot cost on `ids` (1, T), cheapest
    first, and suggest --layers / --heads for the k cheapest (default half): one forward per layer or head, and one
    per suggestion. Says first (through `say`, a line at a time) how many forwards that is and, given one forward's
    time `forward_s`, about how long; then each table and its suggestion."""
    from .record import describe_selection

    norms = _norms(model)
    per_head = type(norms[0][1]).per_head
    rankings = [("layer", "--layers", layer_costs)] + ([("head", "--heads", head_costs)] if per_head else [])
    counts = [len(norms)] + ([model.config.num_attention_heads] if per_head else [])
    forwards = sum(2 + n for n in counts)  # per ranking: its baseline, one per layer or head, its suggestion
    what = f"{len(norms)} patched layers" + (f" and {counts[1]} query heads" if per_head else "")
    estimate = f", about {forwards * forward_s:.0f} s at {forward_s:.2f} s a forward here" if forward_s else ""
    say(f"ranking {what}: {forwards} forwards of {ids.shape[-1]} tokens{estimate}")
    for what, flag, measure in rankings:
        baseline, costs = measure(model, ids, progress=progress)
        say(describe_costs(costs, what, baseline))
        chosen = suggest(costs, min(k or max(1, len(costs) // 2), len(costs)))
        loss = selection_loss(model, ids, *((chosen, None) if what == "layer" else (None, chosen)))
        say(f"suggested: {flag} {describe_selection(chosen)} (the {len(chosen)} cheapest {what}s together: loss "
            f"{loss:.4f}, {loss - baseline:+.4f})")


__all__ = ["Cost", "describe_costs", "head_costs", "layer_costs", "rank_and_suggest", "selection_loss", "suggest",
           "text_loss"]
