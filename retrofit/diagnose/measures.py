"""The paper's measures as pure tensor math: no model, no I/O, no retrofit import.

Equation numbers are those of Mudarisov et al., "Limitations of Normalization in Attention Mechanism"
(arXiv, 2025). Shapes, batched over any leading dims `...`:

    weights  (..., R, n)   R query rows over n keys; 0 on keys the row may not see
    visible  (..., R, n)   bool, True where the row may see the key
    x        (..., n, D)   the vectors the weights average (diagnose passes the head's value vectors)

"L" in the paper is the number of keys a query sees; here it is per row: n_r = visible[r].sum().
A measure that is undefined for a row (a top-N set that leaves no key outside it) comes back NaN.
"""

from __future__ import annotations

import math

import torch

# ---------------------------------------------------------------- weight maps (Eq. 2, 3 and the norms)


def softmax_weights(logits: torch.Tensor) -> torch.Tensor:
    """Eq. (2): a_i = exp(l_i) / sum_j exp(l_j); -inf logits are hidden keys (weight 0)."""
    e = _safe_exp(logits)
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300)


def psoftmax_weights(logits: torch.Tensor, p: float) -> torch.Tensor:
    """p-softmax: a_i = exp(l_i) / ||exp(l)||_p (p=1 is Eq. 2; p=2 keeps sum a_i^2 = 1)."""
    e = _safe_exp(logits)
    return e / e.pow(p).sum(-1, keepdim=True).pow(1.0 / p).clamp_min(1e-300)


def softmax1_weights(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax+1: a_i = exp(l_i) / (exp(b) + sum_j exp(l_j)); `sink` b broadcasts to logits[..., :1]."""
    sink = sink.to(logits.dtype).expand_as(logits[..., :1])
    m = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - m)
    return e / (torch.exp(sink - m) + e.sum(-1, keepdim=True))


def _safe_exp(logits):
    m = logits.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    return torch.exp(logits - m)


# ---------------------------------------------------------------- vanishing attention (Lemma 1, Cor. 1)


def row_stats(weights: torch.Tensor, visible: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: n (visible keys), mass sum a_i, max a_i, ||a||_2^2, entropy of a / sum a (nats).

    Uniform weights over n keys give entropy log n, max 1/n and ||a||_2^2 = 1/n. For norms whose
    weights do not sum to 1 (p-softmax, softmax+1) the entropy is that of the renormalized row.
    """
    w = weights.masked_fill(~visible, 0.0)
    mass = w.sum(-1)
    prob = w / mass.clamp_min(1e-300)[..., None]
    entropy = -torch.special.xlogy(prob, prob).sum(-1)
    return {"n": visible.sum(-1).to(w.dtype), "mass": mass, "max_weight": w.amax(-1),
            "sq_norm": w.pow(2).sum(-1), "entropy": entropy}


def log_weight_bounds(log_n: torch.Tensor, a: torch.Tensor, *, p: float = 1.0,
                      sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Corollary 1 (Eq. 5), in logs and generalized per norm: (log lower, log upper) bound on every a_i.

    `a` bounds the logits the norm sees, |l_i| <= a. Softmax with l_i = q.k_i / T and a = Delta / T,
    Delta = ||q|| max_j ||k_j||, gives Eq. (5): (1/L) e^(-2a) <= a_i <= (1/L) e^(2a). The others:

        softmax, avnorm   log a_i in -log n -+ 2a         (avnorm leaves the weights as softmax)
        ssmax             the same with a -> s log(n) a   (the caller scales a: L enters theta, so
                                                           Lemma 1's premise fails, as intended)
        psoftmax          log a_i in -(log n)/p -+ 2a     (a_i = e^l_i / (sum e^(p l_j))^(1/p))
        softmax1          [e^-a / (e^b + n e^a), e^a / (e^b + n e^-a)]  (b the sink logit)

    By what the norm gives (Norm.bound_terms): a sink logit -> the softmax+1 bounds; else p (1 for softmax).
    """
    if sink is not None:
        b = sink.to(a.dtype).expand_as(a)
        lower = -a - torch.logaddexp(b, log_n + a)
        upper = a - torch.logaddexp(b, log_n - a)
        return lower, upper
    return -log_n / p - 2 * a, -log_n / p + 2 * a


# ---------------------------------------------------------------- variance collapse (the L2-softmax post)


def channel_variance(x: torch.Tensor) -> torch.Tensor:
    """Variance across the last (channel) dim, per vector: what AVNorm's per-head GroupNorm divides by."""
    return x.var(-1, unbiased=False)


def predicted_output_variance(weights: torch.Tensor, value_var: torch.Tensor) -> torch.Tensor:
    """Var(sum_i a_i v_i) = sum_i a_i^2 Var(v_i) for uncorrelated values: ||a||_2^2 Var(v) when all
    values share one variance (the post's Var = ||A||_2^2 for unit-variance values).
    weights (..., R, n), value_var (..., n) -> (..., R)."""
    return (weights.pow(2) * value_var[..., None, :]).sum(-1)


# ---------------------------------------------------------------- top-N sets (Eq. 6)


def _ranks(weights: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Rank of each key in its row by decreasing weight (0 = largest); hidden keys rank last."""
    key = weights.masked_fill(~visible, -1.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks


def _top_sets(weights, visible, ns):
    """(selected (..., R, G, n) bool, outside (..., R, G, n) bool, ranks) for each N in `ns`."""
    ranks = _ranks(weights, visible)
    n_grid = torch.as_tensor(ns, device=weights.device)
    selected = (ranks[..., None, :] < n_grid[:, None]) & visible[..., None, :]
    outside = visible[..., None, :] & ~selected
    return selected, outside, ranks


def _context_vectors(weights, x, selected):
    """s_N = sum_{i in I_N} a_i x_i (Eq. 6) for every N: (..., R, G, D), and x_i . s_N: (..., R, G, n)."""
    sel_w = selected.to(weights.dtype) * weights[..., None, :]          # (..., R, G, n)
    lead, (R, G, n) = sel_w.shape[:-3], sel_w.shape[-3:]
    s = (sel_w.reshape(*lead, R * G, n) @ x).reshape(*lead, R, G, -1)  # (..., R, G, D)
    xs = (s.reshape(*lead, R * G, -1) @ x.transpose(-1, -2)).reshape(*lead, R, G, n)
    return s, xs


# ---------------------------------------------------------------- distance (Theorem 1)


def topn_distance(weights: torch.Tensor, x: torch.Tensor, visible: torch.Tensor, ns, *,
                  bound_ns=None) -> dict[str, torch.Tensor]:
    """Theorem 1 for each N in `ns`, per row: each value (..., R, G).

    true      d~ = sum_{i not in I_N} ||a_i x_i - s||_2                                  (Eq. 7)
    bound     rho d_1 + max_{j in I_N} ||x_j|| (abar_N (L - N) - rho)                 (Thm 1.1)
              d_1 = max_{i not in I_N, j in I_N} ||x_i - x_j||, abar_N = sum_{I_N} a_i, and
              rho = sum_{i not in I_N} a_i (= 1 - abar_N for weights that sum to 1, as in the
              paper; the proof — ||a_i x_i - s|| <= a_i d_1 + (abar_N - a_i) max ||x_j|| — needs only
              a_i <= abar_N, so it holds for every norm). Only for N in `bound_ns` (default all), NaN
              elsewhere: d_1 costs a (top-N x L) distance matrix per row.
    expected  E_0 = (L-N)/L sum_i ||a_i x_i - N/(L-1) sum_{j!=i} a_j x_j||_2               (Thm 1.2)
    eps       the bound on E - E_0: 1/2 (1 - N/L) sum_i N/(L-1) sum_{j!=i} a_j^2 ||x_j||^2 / ||...||
    expected_printed   (L-N)/L sum_i ||(a_i + N/(L-1)) x_i - xbar||_2, xbar = sum_i a_i x_i: Thm 1.2's
              main term as printed in the paper.

    E_0 is Jensen's term of the exact expectation E = E_{I_N ~ U}[d~] (Eq. 8): E[s | i not in I_N]
    = N/(L-1) (xbar - a_i x_i), so E_0 <= E <= E_0 + eps (tested against enumeration). The printed
    main term is not E (it keeps the whole xbar in every summand, so it grows like (L - N) ||xbar||
    while E stays near sum_i ||a_i x_i||, Corollary 2(i)); diagnose reports both, because the paper's
    Figure 2 and its critical N follow the printed one.
    """
    w = weights.masked_fill(~visible, 0.0)
    selected, outside, ranks = _top_sets(w, visible, ns)
    s, xs = _context_vectors(w, x, selected)
    x_sq = x.pow(2).sum(-1)[..., None, :]                                   # (..., 1, n)
    a_sq = w.pow(2) * x_sq                                                  # ||a_i x_i||^2 (..., R, n)
    dist = (a_sq[..., None, :] - 2 * w[..., None, :] * xs + s.pow(2).sum(-1, keepdim=True)).clamp_min(0).sqrt()
    n = visible.sum(-1, keepdim=True).to(w.dtype)                           # (..., R, 1)
    N = torch.as_tensor(ns, dtype=w.dtype, device=w.device)                 # (G,)
    empty = outside.sum(-1) == 0                                            # nothing left outside I_N
    out = {"true": torch.where(outside, dist, 0).sum(-1)}
    del dist
    out.update(_expectations(w, x, visible, a_sq, x_sq, n, N))
    bound_ns = list(ns) if bound_ns is None else [N for N in bound_ns if N in ns]
    if bound_ns:
        out["bound"] = _bound(w, x, x_sq, (selected, outside, ranks), n, N, list(ns), bound_ns)
    return {k: v.masked_fill(empty, math.nan) for k, v in out.items()}


def _expectations(w, x, visible, a_sq, x_sq, n, N) -> dict[str, torch.Tensor]:
    """Theorem 1.2 over the row's visible keys (expected, eps, expected_printed; see topn_distance), each term a
    quadratic in p = N/(L-1) per key:
      Jensen's  ||(1+p) a_i x_i - p xbar||^2 = a_i^2|x_i|^2 (1+p)^2 - 2 p (1+p) a_i x_i.xbar + p^2 |xbar|^2
      printed   ||(a_i+p) x_i - xbar||^2    = (a_i^2|x_i|^2 - 2 a_i x_i.xbar + |xbar|^2)
                                              + p (2 a_i|x_i|^2 - 2 x_i.xbar) + p^2 |x_i|^2"""
    out = {}
    keep = (n - N) / n                                                      # (L - N) / L, (..., R, G)
    p = (N / (n - 1).clamp_min(1))[..., :, None]                            # (..., R, G, 1)
    xbar = w @ x                                                            # (..., R, D)
    x_dot_xbar = xbar @ x.transpose(-1, -2)                                 # x_i . xbar (..., R, n)
    xbar_sq = xbar.pow(2).sum(-1, keepdim=True)                             # (..., R, 1)
    vis = visible.to(w.dtype)
    wx = w * x_dot_xbar                                                     # a_i x_i . xbar
    mu = (a_sq[..., None, :] * (1 + p) ** 2 - 2 * p * (1 + p) * wx[..., None, :]
          + p ** 2 * (xbar_sq * vis)[..., None, :]).clamp_min(0).sqrt()     # 0 on hidden keys
    out["expected"] = keep * mu.sum(-1)
    spread = a_sq.sum(-1, keepdim=True) - a_sq                              # sum_{j!=i} a_j^2 ||x_j||^2
    out["eps"] = 0.5 * keep * p[..., 0] * (spread[..., None, :] / mu.clamp_min(1e-12) * visible[..., None, :]).sum(-1)
    del mu
    const = (a_sq - 2 * wx + xbar_sq) * vis
    lin = (2 * w * x_sq - 2 * x_dot_xbar) * vis
    quad = x_sq * vis
    printed = (const[..., None, :] + p * (lin[..., None, :] + p * quad[..., None, :])).clamp_min(0).sqrt()
    out["expected_printed"] = keep * printed.sum(-1)
    return out


def _bound(w, x, x_sq, top_sets, n, N, ns: list, bound_ns: list) -> torch.Tensor:
    """Theorem 1.1's bound (see topn_distance) for the N in bound_ns, NaN in the other columns: (..., R, G)."""
    selected, outside, ranks = top_sets
    cols = [ns.index(k) for k in bound_ns]
    abar = (w[..., None, :] * selected[..., cols, :]).sum(-1)              # (..., R, G')
    rho = (w[..., None, :] * outside[..., cols, :]).sum(-1)
    max_sel = (x_sq.sqrt()[..., None, :] * selected[..., cols, :]).amax(-1)
    d1 = _max_cross_distance(x, ranks, outside[..., cols, :], bound_ns)
    bound = torch.full((*rho.shape[:-1], len(ns)), math.nan, dtype=rho.dtype, device=rho.device)
    bound[..., cols] = rho * d1 + max_sel * (abar * (n - N[cols]) - rho)
    return bound


def _max_cross_distance(x, ranks, outside, ns):
    """d_1 = max_{i outside I_N, j in I_N} ||x_i - x_j|| per row and N: (..., R, G)."""
    top = min(max(ns), ranks.shape[-1])
    order = ranks.argsort(-1)[..., :top]                                    # (..., R, top) key ids
    x_rows = x[..., None, :, :].expand(*ranks.shape, x.shape[-1])           # (..., R, n, D) view
    x_top = x_rows.gather(-2, order[..., None].expand(*order.shape, x.shape[-1]))
    gram = x_top @ x.transpose(-1, -2)[..., None, :, :]                     # (..., R, top, n)
    sq = x.pow(2).sum(-1)
    pair = (x_top.pow(2).sum(-1)[..., None] + sq[..., None, None, :] - 2 * gram).clamp_min(0).sqrt()
    result = []
    for g, N in enumerate(ns):
        masked = pair[..., : min(N, top), :].masked_fill(~outside[..., g, None, :], -math.inf)
        result.append(masked.amax((-1, -2)))
    return torch.stack(result, -1)


# ---------------------------------------------------------------- geometric separability (Theorem 2)


def min_pairwise_distance(x: torch.Tensor) -> torch.Tensor:
    """delta of Assumption 2 for every prefix: out[..., t] = min_{i < j <= t} ||x_i - x_j|| (inf at t=0).

    x (..., T, D) -> (..., T). One T x T distance matrix per call: callers pass one head at a time."""
    T = x.shape[-2]
    dist = torch.cdist(x, x)                                                # (..., T, T)
    lower = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-1)   # i > j: pair counted at row i
    nearest = dist.masked_fill(~lower, math.inf).amin(-1)                   # min over earlier keys
    return torch.cummin(nearest, -1).values


def separability(weights: torch.Tensor, x: torch.Tensor, visible: torch.Tensor, ns,
                 delta: torch.Tensor, radius: float = 1.0) -> dict[str, torch.Tensor]:
    """Theorem 2 for each N in `ns`, per row: each value (..., R, G). x must lie on the sphere of
    radius M = `radius` (Assumption 1); delta (..., R) is the min pairwise distance (Assumption 2).

    r      min_{i not in I_N} ||s - a_i x_i||           (Section 3.2: every non-selected key is outside B_r(s))
    ratio  N_s / N, N_s = #{i in I_N : ||a_i x_i - s|| <= r}                                  (Eq. 10)
    lower  1 - (1 / (r N)) sum_{i in I_N} xi_i                                                (Eq. 11)
    upper  (1/N) sum_{i in I_N} exp(-(r - xi_i)^2 / (16 M^2))                                 (Eq. 11)
    xi_i^2 = M^2 sum_{j in I_N, j!=i} a_j^2 + (M^2 - delta^2/2) sum_{j!=k, both in I_N \\ {i}} a_j a_k (Eq. 12)

    Since x_j . x_k <= M^2 - delta^2/2, ||a_i x_i - s|| = ||sum_{j!=i} a_j x_j|| <= xi_i exactly, so the
    lower bound holds for every instance (Markov). The upper bound is a statement about E[N_s] under
    random spherical embeddings, not a per-instance bound: when r > max xi_i every selected token is
    inside and N_s / N = 1 exceeds it. Diagnose reports how often it holds.
    """
    w = weights.masked_fill(~visible, 0.0)
    selected, outside, _ = _top_sets(w, visible, ns)
    s, xs = _context_vectors(w, x, selected)
    x_sq = x.pow(2).sum(-1)[..., None, :]
    dist = (w.pow(2) * x_sq)[..., None, :] - 2 * w[..., None, :] * xs + s.pow(2).sum(-1, keepdim=True)
    dist = dist.clamp_min(0).sqrt()                                         # ||a_i x_i - s|| (..., R, G, n)
    r = dist.masked_fill(~outside, math.inf).amin(-1)                       # (..., R, G)
    N = torch.as_tensor(ns, dtype=w.dtype, device=w.device)
    inside = ((dist <= r[..., None]) & selected).sum(-1).to(w.dtype)

    sel_w = w[..., None, :] * selected                                      # (..., R, G, n)
    abar = sel_w.sum(-1, keepdim=True)
    q = sel_w.pow(2).sum(-1, keepdim=True) - sel_w.pow(2)                   # sum_{j!=i} a_j^2
    cross = (abar - sel_w).pow(2) - q                                       # sum_{j!=k, both != i} a_j a_k
    m2 = radius ** 2
    xi = (m2 * q + (m2 - delta[..., None, None].pow(2) / 2) * cross).clamp_min(0).sqrt()
    xi_sum = (xi * selected).sum(-1)
    upper = (torch.exp(-(r[..., None] - xi).pow(2) / (16 * m2)) * selected).sum(-1) / N
    empty = outside.sum(-1) == 0
    out = {"r": r, "ratio": inside / N, "lower": 1 - xi_sum / (r.clamp_min(1e-30) * N), "upper": upper}
    return {k: v.masked_fill(empty, math.nan) for k, v in out.items()}


# ---------------------------------------------------------------- gradient sensitivity (Lemma 2, Cor. 3)


def softmax_jacobian(alpha: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """d softmax(l / T) / d l = (diag(a) - a a^T) / T: (..., n) -> (..., n, n).

    Its spectral norm is at most 1/(2T), reached by two tied weights of 1/2 (eigenvector (1, -1)/sqrt 2);
    the paper's Corollary 3 states min{1/(4T), sqrt 2}, which such ties exceed."""
    return (torch.diag_embed(alpha) - alpha[..., :, None] * alpha[..., None, :]) / temperature


def corollary3_bound(temperature) -> torch.Tensor:
    """Corollary 3 as printed: ||grad_l a||_2 <= min{1/(4T), sqrt 2}."""
    t = torch.as_tensor(temperature, dtype=torch.float64)
    return torch.minimum(1 / (4 * t), torch.full_like(t, math.sqrt(2)))


def unit_directions(visible: torch.Tensor, generator: torch.Generator | None = None,
                    dtype=torch.float64) -> torch.Tensor:
    """Random directions dl with ||dl||_2 = 1 over each row's visible keys (0 on hidden keys)."""
    d = torch.randn(visible.shape, generator=generator, dtype=dtype, device=visible.device) * visible
    return d / d.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def finite_difference_gain(weight_fn, logits: torch.Tensor, direction: torch.Tensor, temperature: float,
                           eps: float, base: torch.Tensor | None = None) -> torch.Tensor:
    """Section 3.3: g(T, eps) = ||a_T(l + eps dl) - a_T(l)||_2 / eps with ||dl||_2 = 1, per row.

    weight_fn(logits, T) is the normalization at temperature T (softmax: softmax(l / T)); logits are
    (..., n) with -inf on hidden keys. Diagnose passes the model's scaled logits, so T = 1 is the
    model as it is and T < 1 sharpens it. `base` = weight_fn(logits, T) when already computed."""
    base = weight_fn(logits, temperature) if base is None else base
    moved = weight_fn(logits + eps * direction, temperature)
    return (moved - base).norm(dim=-1) / eps


# ---------------------------------------------------------------- statistics


def critical_n(true_by_n: dict, expected_by_n: dict, alpha: float = 0.01) -> tuple[int | None, dict]:
    """Section 3.1: the smallest N at which a two-sample Kolmogorov-Smirnov test cannot tell the true
    distances d~ from their random-set expectation E_0 at level alpha. Each dict maps N -> 1-D samples
    (diagnose: one value per head). Returns (critical N or None, {N: p-value})."""
    from scipy.stats import ks_2samp

    pvalues = {}
    for N in sorted(true_by_n):
        a = torch.as_tensor(true_by_n[N]).flatten()
        b = torch.as_tensor(expected_by_n[N]).flatten()
        a, b = a[torch.isfinite(a)], b[torch.isfinite(b)]
        if len(a) < 2 or len(b) < 2:
            continue
        pvalues[N] = float(ks_2samp(a.numpy(), b.numpy()).pvalue)
    critical = next((N for N, pv in pvalues.items() if pv >= alpha), None)
    return critical, pvalues


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y against log x over the finite, positive points (nan if < 2)."""
    x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    ok = (x > 0) & (y > 0) & torch.isfinite(x) & torch.isfinite(y)
    if int(ok.sum()) < 2:
        return math.nan
    lx, ly = x[ok].log(), y[ok].log()
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())
