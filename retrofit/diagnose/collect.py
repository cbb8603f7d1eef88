"""Run one model over text windows and reduce every measure to per-head numbers as the forward runs.

    result = diagnose_model(model, windows, Plan(lengths=[32, 64, 128]))   # windows: (B, T) token ids

For each length L the rows are the last `queries` query positions before L (row r sees n_r <= L
keys); every measure is averaged over those rows and the B windows, per (layer, head), and only those
(layers, H) arrays are kept. Each layer's rows are measured inside its attention call and dropped.

The x_i of the paper are the head's **value vectors** v_i (per KV head, as the head sees them): the
context vector of Eq. (6), s = sum_{I_N} a_i x_i, is then exactly the head's output restricted to its
top-N keys, so Theorem 1 speaks about what the head actually sends on. The residual-stream inputs
would be the same for every head and ignore W_V. Theorem 2 needs embeddings on a sphere (Assumption
1): it uses the same value vectors scaled to unit norm (N_s / N and both bounds are scale-free, so
M = 1), with delta the minimum pairwise distance among the row's visible keys (Assumption 2).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import RetrofitError
from . import measures
from .capture import LayerRows, capture_rows

PAPER_NS = (1, 5, 10, 20, 100)  # Figure 2b, at the largest length


@dataclass
class Plan:
    """What to measure. Defaults mirror the paper's Section 3."""

    lengths: list[int]
    queries: int = 8                    # query rows per length: positions L-q .. L-1
    distance_n: int = 5                 # Figure 2a: N fixed while L grows
    distance_ns: tuple = PAPER_NS       # Figure 2b: N grows at the largest L
    separability_ns: tuple = (1, 2, 4, 8, 16, 32, 64, 100)   # Figure 3
    temperatures: tuple = tuple(float(t) for t in np.logspace(-3, 2, 11))  # Figure 4
    epsilons: tuple = (1e-3, 1e-1, 10.0)
    ks_alpha: float = 0.01
    ks_points: int = 12                 # N values tried per length when searching the critical N
    head_chunk_elements: int = 2 ** 23  # bound on (B * heads * rows * L * N) per distance call
    seed: int = 0
    rows_by_length: dict = field(init=False)

    def __post_init__(self):
        self.lengths = sorted({int(L) for L in self.lengths})
        if not self.lengths or self.lengths[0] < 2:
            raise RetrofitError(f"lengths must be integers >= 2, got {self.lengths}")
        self.rows_by_length, start = {}, 0
        for L in self.lengths:
            q = min(self.queries, max(1, L // 4))
            self.rows_by_length[L] = (start, q)
            start += q

    @property
    def positions(self) -> list[int]:
        return [L - q + j for L, (_, q) in self.rows_by_length.items() for j in range(q)]

    def usable(self, L: int, ns) -> list[int]:
        """The N of `ns` that leave every row of length L at least one key outside its top-N set."""
        q = self.rows_by_length[L][1]
        return sorted({int(N) for N in ns if 1 <= N <= L - q})

    def figure_ns(self, L: int) -> list[int]:
        return self.usable(L, {self.distance_n} | (set(self.distance_ns) if L == self.lengths[-1] else set()))

    def ks_ns(self, L: int) -> list[int]:
        top = L - self.rows_by_length[L][1]
        return self.usable(L, np.unique(np.round(np.geomspace(1, max(top, 1), self.ks_points))))


class Accumulator:
    """Per-(layer, head) running means (and maxima) of row measures, keyed by name."""

    def __init__(self, layers: int, heads: int):
        self.shape = (layers, heads)
        self.sums = defaultdict(lambda: np.zeros(self.shape))
        self.counts = defaultdict(lambda: np.zeros(self.shape))
        self.maxima = defaultdict(lambda: np.full(self.shape, -np.inf))

    def add(self, key: str, layer: int, values: torch.Tensor, keep_max: bool = False):
        """values (B, H, R): their per-head mean over windows and rows (and max with keep_max) go to `key`."""
        v = values.detach().double()
        ok = torch.isfinite(v)
        self.sums[key][layer] += torch.where(ok, v, 0).sum((0, 2)).numpy()
        self.counts[key][layer] += ok.sum((0, 2)).numpy()
        if keep_max:
            self.maxima[key][layer] = np.maximum(self.maxima[key][layer],
                                                 torch.where(ok, v, -math.inf).amax((0, 2)).numpy())

    def add_columns(self, prefix: str, labels, layer: int, values: torch.Tensor, h0: int = 0):
        """values (B, h, R, G): column g goes to key f'{prefix}/{labels[g]}', heads h0.. of the layer."""
        v = values.detach().double()
        ok = torch.isfinite(v)
        sums = torch.where(ok, v, 0).sum((0, 2)).numpy()                    # (h, G)
        counts = ok.sum((0, 2)).numpy()
        heads = slice(h0, h0 + v.shape[1])
        for g, label in enumerate(labels):
            self.sums[f"{prefix}/{label}"][layer, heads] += sums[:, g]
            self.counts[f"{prefix}/{label}"][layer, heads] += counts[:, g]

    def mean(self, key: str) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.sums[key] / self.counts[key]

    def max(self, key: str) -> np.ndarray:
        return self.maxima[key]


def measure_layer(rows: LayerRows, plan: Plan, acc: Accumulator) -> None:
    """Every measure of every length for one layer's captured rows."""
    delta = _prefix_min_distance(rows)                                      # (B, H, T)
    for L, (start, q) in plan.rows_by_length.items():
        sl = slice(start, start + q)
        _vanishing(rows, L, sl, acc)
        _variance(rows, L, sl, acc)
        _distance_and_separability(rows, L, sl, plan, delta, acc)
    _gradient(rows, plan, acc)


def _vanishing(rows: LayerRows, L: int, sl: slice, acc: Accumulator) -> None:
    """1. Lemma 1 / Corollary 1: entropy, extreme weights, and the bound (1/n) e^(+-2a), a = Delta / T."""
    layer, H = rows.layer, rows.weights.shape[1]
    w, vis, n = rows.weights[:, :, sl, :L], rows.visible[:, :, sl, :L], rows.n[:, :, sl, 0]
    stats = measures.row_stats(w, vis)
    for k in ("entropy", "max_weight", "sq_norm", "mass"):
        acc.add(f"{L}/{k}", layer, stats[k])
    k_max = rows.k_norm[:, :, None, :L].masked_fill(~vis, 0).amax(-1)      # max_j ||k_j|| (B, H, q)
    a = rows.q_norm[:, :, sl] * k_max * rows.scaling * rows.logit_factor[:, :, sl, 0].abs()
    sink = None if rows.sink is None else rows.sink.view(1, H, 1).expand_as(a)
    lo, hi = measures.log_weight_bounds(n.log(), a, p=rows.p, sink=sink)
    min_w = w.masked_fill(~vis, math.inf).amin(-1)
    acc.add(f"{L}/min_weight", layer, min_w)
    acc.add(f"{L}/cor1_exponent", layer, 2 * a)
    holds = (min_w.log() >= lo - 1e-4) & (stats["max_weight"].log() <= hi + 1e-4)
    acc.add(f"{L}/cor1_holds", layer, holds.double())
    # how much of the bound is used: log(n max a) / (2a) and log(n min a) / (-2a), both <= 1 by Eq. (5)
    acc.add(f"{L}/cor1_upper_use", layer, (n * stats["max_weight"]).log() / (2 * a))
    acc.add(f"{L}/cor1_lower_use", layer, -(n * min_w).log() / (2 * a))
    eff = rows.logits[:, :, sl, :L] * rows.logit_factor[:, :, sl]
    span = eff.masked_fill(~vis, -math.inf).amax(-1) - eff.masked_fill(~vis, math.inf).amin(-1)
    acc.add(f"{L}/logit_range", layer, span)


def _variance(rows: LayerRows, L: int, sl: slice, acc: Accumulator) -> None:
    """2. The L2-softmax post: channel variance of the head output (before / after the norm) and
    its prediction sum_i a_i^2 Var(v_i) for uncorrelated values."""
    layer = rows.layer
    w, vis, n = rows.weights[:, :, sl, :L], rows.visible[:, :, sl, :L], rows.n[:, :, sl, 0]
    var_v = measures.channel_variance(rows.values[:, :, :L])               # (B, H, L)
    acc.add(f"{L}/var_pred", layer, measures.predicted_output_variance(w, var_v))
    acc.add(f"{L}/var_value", layer, (var_v[:, :, None, :] * vis).sum(-1) / n)
    acc.add(f"{L}/var_out_raw", layer, measures.channel_variance(rows.head_out_raw[:, :, sl]))
    acc.add(f"{L}/var_out", layer, measures.channel_variance(rows.head_out[:, :, sl]))


def _distance_and_separability(rows: LayerRows, L: int, sl: slice, plan: Plan, delta, acc: Accumulator) -> None:
    """3. Theorem 1 at the figure's N and the KS search's N; 4. Theorem 2 at the largest L.
    A few heads at a time, so the (rows x N x L) tensors stay under plan.head_chunk_elements."""
    layer, H = rows.layer, rows.weights.shape[1]
    w, vis, x = rows.weights[:, :, sl, :L], rows.visible[:, :, sl, :L], rows.values[:, :, :L]
    dist_ns = sorted(set(plan.figure_ns(L)) | set(plan.ks_ns(L)))
    sep_ns = plan.usable(L, plan.separability_ns) if L == plan.lengths[-1] else []
    widest = max(len(dist_ns), len(sep_ns), max(plan.figure_ns(L), default=1))
    chunk = max(1, plan.head_chunk_elements // (w.shape[0] * w.shape[2] * L * widest))
    for h0 in range(0, H, chunk):
        hs = slice(h0, h0 + chunk)
        wh, vh, xh = w[:, hs], vis[:, hs], x[:, hs]
        if dist_ns:
            d = measures.topn_distance(wh, xh, vh, dist_ns, bound_ns=plan.figure_ns(L))
            for k, v in d.items():
                acc.add_columns(f"{L}/dist/{k}", dist_ns, layer, v, h0)
        if sep_ns:
            unit = xh / xh.norm(dim=-1, keepdim=True).clamp_min(1e-12)     # Assumption 1, M = 1
            delta_rows = delta[:, hs][:, :, rows.positions[sl]]             # Assumption 2 per row (B, h, q)
            s = measures.separability(wh, unit, vh, sep_ns, delta_rows)
            s["upper_holds"] = (s["ratio"] <= s["upper"]).double().masked_fill(s["ratio"].isnan(), math.nan)
            for k in ("ratio", "lower", "upper", "upper_holds"):
                acc.add_columns(f"{L}/sep/{k}", sep_ns, layer, s[k], h0)


def _gradient(rows: LayerRows, plan: Plan, acc: Accumulator) -> None:
    """5. Corollary 3: g(T, eps) on the rows of the largest length, in float64 (eps = 1e-3 needs it),
    one random unit direction per row; mean and max over rows per head."""
    L = plan.lengths[-1]
    start, q = plan.rows_by_length[L]
    sl = slice(start, start + q)
    logits, vis, n = rows.logits[:, :, sl, :L].double(), rows.visible[:, :, sl, :L], rows.n[:, :, sl].double()
    direction = measures.unit_directions(vis, torch.Generator().manual_seed(plan.seed * 1000 + rows.layer))
    fn = lambda scores, t: rows.weight_fn(scores, t, n)  # noqa: E731
    for t in plan.temperatures:
        base = fn(logits, t)
        for eps in plan.epsilons:
            g = measures.finite_difference_gain(fn, logits, direction, t, eps, base=base)
            acc.add(f"grad/{eps:g}/{t:.6g}", rows.layer, g, keep_max=True)


def _prefix_min_distance(rows: LayerRows) -> torch.Tensor:
    """delta for every prefix of unit value vectors, one KV head at a time: (B, H, T)."""
    v = rows.values[:, :: rows.values.shape[1] // rows.kv_heads]           # one copy per KV head
    unit = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    delta = torch.stack([measures.min_pairwise_distance(unit[:, h]) for h in range(unit.shape[1])], 1)
    return delta.repeat_interleave(rows.values.shape[1] // rows.kv_heads, 1)


def _layer_count(model) -> int:
    config = model.config
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise RetrofitError(f"cannot tell how many layers {type(model).__name__} has (no num_hidden_layers in its config)")


@torch.no_grad()
def diagnose_model(model, windows: torch.Tensor, plan: Plan, *, label: str = "model", progress: bool = True) -> dict:
    """Run `model` on `windows` (B, T) with T >= max(plan.lengths): the Accumulator of per-head means
    (summary.summarize turns it into the JSON result)."""
    if windows.shape[1] < plan.lengths[-1]:
        raise RetrofitError(f"windows have {windows.shape[1]} tokens but the longest length is {plan.lengths[-1]}")
    layers = _layer_count(model)
    heads = int(getattr(model.config, "num_attention_heads", None) or model.config.n_head)
    acc, seen = Accumulator(layers, heads), []
    bar = tqdm(total=layers, desc=f"diagnose {label}", unit="layer", disable=not progress, leave=False)

    def on_layer(rows: LayerRows):
        measure_layer(rows, plan, acc)
        seen.append(rows.layer)
        bar.update(1)

    device = next(model.parameters()).device
    ids = windows[:, : plan.lengths[-1]].to(device)
    try:
        with capture_rows(model, plan.positions, on_layer):
            model(input_ids=ids, use_cache=False)
    finally:
        bar.close()
    if sorted(seen) != list(range(layers)):
        raise RetrofitError(f"diagnose saw attention calls for layers {sorted(set(seen))} of {layers}: this "
                            f"model does not route every layer through transformers' attention registry")
    return {"layers": layers, "heads": heads, "windows": int(windows.shape[0]), "acc": acc}
