"""Plots and a markdown report from diagnose results (the dicts of summary.summarize).

    python -m retrofit.diagnose.figures diag/  # redraw report.md and the figures from diag/diagnose.json
    write_report(results, out_dir, header)     # report.md + vanishing.png, variance.png and, per model,
                                               # distance_, separability_, gradient_ and heads_<label>.png

Figures mirror the paper's: Figure 2 (distance), Figure 3 (separability), Figure 4 (gradient); the
entropy and variance curves put one line per model on the same axes.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from ..io.atomic import atomic_write_text, atomic_writer
from .markdown import PAPER, markdown


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label).strip("_") or "model"


def _floats(values) -> np.ndarray:
    return np.array(values, dtype=float)  # None (nan in the JSON) -> nan


def _per_head(result, key) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in result["per_head"][key]], float).ravel()


def _band(result, fmt, xs):
    """Median and interquartile range across heads of per_head[fmt.format(x)] for each x."""
    qs = [np.nanquantile(_per_head(result, fmt.format(x)), [0.25, 0.5, 0.75]) for x in xs]
    return np.array(qs).T


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path, dpi: int = 120):
    """Written atomically: never through a link below the --out folder (retrofit.io.atomic.atomic_writer)."""
    fig.tight_layout()
    with atomic_writer(path, binary=True) as f:
        fig.savefig(f, format="png", dpi=dpi)
    plt.close(fig)


def plot_vanishing(results, path):
    """Entropy and max weight vs L (one line per model), and Corollary 1's band against what is seen."""
    plt = _plt()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for r in results:
        Ls = r["lengths"]
        for ax, key in ((ax1, "entropy"), (ax2, "max_weight")):
            lo, mid, hi = _band(r, "{}/" + key, Ls)
            line, = ax.plot(Ls, mid, marker="o", label=r["label"])
            ax.fill_between(Ls, lo, hi, color=line.get_color(), alpha=0.15)
        v = [r["summary"]["vanishing"][str(L)] for L in Ls]
        c = line.get_color()
        ax3.plot(Ls, _floats([x["cor1_upper_use"] for x in v]), "o-", color=c, label=f"{r['label']}: upper side")
        ax3.plot(Ls, _floats([x["cor1_lower_use"] for x in v]), "v:", color=c, label=f"{r['label']}: lower side")
    Ls = np.array(results[0]["lengths"], float)
    ax1.plot(Ls, np.log(Ls), "k--", label="log L (uniform)")
    ax2.plot(Ls, 1 / Ls, "k--", label="1/L (uniform)")
    ax1.set(xscale="log", xlabel="context length L", ylabel="attention entropy (nats)",
            title="Entropy vs L (median, IQR across heads)")
    ax2.set(xscale="log", yscale="log", xlabel="context length L", ylabel="max attention weight",
            title="Vanishing attention (Lemma 1)")
    ax3.axhline(1.0, color="k", ls="--", label="the bound (Eq. 5)")
    ax3.set(xscale="log", xlabel="context length L", ylabel="log(n max a) / (2 Delta/T), log(n min a) / (-2 Delta/T)",
            title="Corollary 1: share of (1/n) e^(+-2 Delta/T) used")
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_variance(results, path):
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        Ls = r["lengths"]
        _, mid, _ = _band(r, "{}/sq_norm", Ls)
        line, = ax1.plot(Ls, mid, marker="o", label=r["label"])
        c = line.get_color()
        _, out, _ = _band(r, "{}/var_out", Ls)
        _, raw, _ = _band(r, "{}/var_out_raw", Ls)
        _, pred, _ = _band(r, "{}/var_pred", Ls)
        ax2.plot(Ls, out, marker="o", color=c, label=f"{r['label']}: head output")
        if not np.allclose(out, raw, rtol=1e-3):
            ax2.plot(Ls, raw, marker=".", ls=":", color=c, label=f"{r['label']}: A V before the norm")
        ax2.plot(Ls, pred, ls="--", color=c, label=f"{r['label']}: predicted sum a_i^2 Var(v_i)")
    Ls = np.array(results[0]["lengths"], float)
    ax1.plot(Ls, 1 / Ls, "k--", label="1/L (uniform)")
    ax1.set(xscale="log", yscale="log", xlabel="context length L", ylabel="||A||_2^2 per query",
            title="||A||_2^2 (median across heads)")
    ax2.set(xscale="log", yscale="log", xlabel="context length L", ylabel="channel variance of head output",
            title="Variance collapse (median across heads)")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=7)
    _save(plt, fig, path)


def plot_distance(r, path):
    """Figure 2: (a) N fixed, L grows; (b) L fixed, N grows; (c) critical N by the KS test."""
    plt = _plt()
    d = r["summary"]["distance"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    series = (("true", "true d~ (Eq. 7)", "tab:green"),
              ("expected_printed", "expectation as printed (Thm 1.2)", "tab:blue"),
              ("expected", "random-set E_0 (Jensen term of E)", "tab:cyan"),
              ("bound", "fixed-set bound (Thm 1.1)", "tab:red"))
    for ax, xs, fmt, xlabel in ((axes[0], [int(L) for L in d["by_length"]], "{}/dist/%s/" + str(d["n"]), "L"),
                                (axes[1], [int(N) for N in d["by_n"]], f"{d['length']}/dist/%s/" + "{}", "top-N")):
        for key, label, color in series:
            lo, mid, hi = _band(r, fmt % key, xs)
            ax.plot(xs, mid, marker="o", color=color, label=label)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15)
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="distance (median, IQR across heads)")
        ax.legend(fontsize=8)
    axes[0].set_title(f"(a) N = {d['n']}")
    axes[1].set_title(f"(b) L = {d['length']}")
    for name, color in (("printed", "tab:blue"), ("exact", "tab:cyan")):
        crit = [(int(L), c[name]["critical_n"]) for L, c in d["critical"].items() if c[name]["critical_n"] is not None]
        if crit:
            Ls, Ns = zip(*crit)
            axes[2].plot(Ls, Ns, "o-", color=color, label=f"critical N vs {name} expectation (KS, alpha = 0.01)")
    Ls = np.array([int(L) for L in d["critical"]], float)
    axes[2].plot(Ls, PAPER["critical_fraction"] * Ls, "k--", label="0.06 L (paper, GPT-2)")
    axes[2].plot(Ls, Ls, "k:", label="N = L")
    axes[2].set(xscale="log", yscale="log", xlabel="L", ylabel="critical top-N", title="(c) critical N")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"{r['label']}: distance statistics (Theorem 1)")
    _save(plt, fig, path)


def plot_separability(r, path):
    """Figure 3: N_s / N across heads (boxes) with the mean lower and upper bounds of Theorem 2."""
    plt = _plt()
    L = str(r["summary"]["separability"]["length"])
    sep = r["summary"]["separability"]["by_n"]
    ns = [int(N) for N in sep]
    data = [_per_head(r, f"{L}/sep/ratio/{N}") for N in ns]
    fig, ax = plt.subplots(figsize=(7, 4))
    pos = np.arange(len(ns))
    ax.boxplot([x[np.isfinite(x)] for x in data], positions=pos, widths=0.5, patch_artist=True,
               boxprops=dict(facecolor="tab:green", alpha=0.5))
    ax.plot(pos, _floats([sep[str(N)]["upper"] for N in ns]), "r^-", label="upper bound (Eq. 11), mean")
    ax.plot(pos, _floats([sep[str(N)]["lower"] for N in ns]), "bv-", label="lower bound (Eq. 11), mean")
    ax.axhspan(*PAPER["plateau"], color="grey", alpha=0.15, label="paper's GPT-2 plateau 0.70-0.85")
    ax.set_xticks(pos, [str(N) for N in ns])
    ax.set(ylim=(-0.05, 1.05), xlabel="top-N", ylabel="N_s / N",
           title=f"{r['label']}: geometric separability at L = {L} (Theorem 2)")
    ax.legend(fontsize=8, loc="lower left")
    _save(plt, fig, path)


def plot_gradient(r, path):
    """Figure 4: max over heads of g(T, eps) against min{1/(4T), sqrt 2}."""
    plt = _plt()
    g = r["summary"]["gradient"]
    T = np.array(g["temperatures"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for eps, v in g["by_eps"].items():
        line, = ax.plot(T, _floats(v["max"]), marker="o", label=f"eps = {eps}: max over heads")
        ax.plot(T, _floats(v["median"]), ls=":", color=line.get_color(), label=f"eps = {eps}: median head")
    ax.plot(T, g["paper_bound"], "k--", label="min{1/(4T), sqrt 2} (Corollary 3)")
    ax.plot(T, g["sup_bound"], "k:", label="1/(2T): exact sup of ||J||_2")
    ax.set(xscale="log", yscale="log", xlabel="temperature T (1 = the model as it is)",
           ylabel="g(T, eps)", title=f"{r['label']}: gradient sensitivity at L = {g['length']}")
    ax.set_ylim(bottom=max(1e-8, np.nanmin([np.nanmin(_floats(v["median"])) for v in g["by_eps"].values()]) / 2))
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_heads(r, path):
    """Per (layer, head) maps at the largest L: entropy / log L, ||A||_2^2 * L, N_s/N."""
    plt = _plt()
    L = r["lengths"][-1]
    b = r["summary"]["by_layer"]
    maps = [(f"{L}/entropy", math.log(L), "entropy / log L"), (f"{L}/sq_norm", 1 / L, "||A||_2^2 * L")]
    if b.get("sep_n"):
        maps.append((f"{L}/sep/ratio/{b['sep_n']}", 1.0, f"N_s/N at N = {b['sep_n']}"))
    fig, axes = plt.subplots(1, len(maps), figsize=(4.5 * len(maps), 0.18 * r["layers"] + 2.5), squeeze=False)
    for ax, (key, scale, title) in zip(axes[0], maps):
        grid = np.array([[np.nan if v is None else v for v in row] for row in r["per_head"][key]], float) / scale
        im = ax.imshow(grid, aspect="auto", cmap="viridis", norm="log" if "sq_norm" in key else None)
        ax.set(xlabel="head", ylabel="layer", title=title)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"{r['label']}: per head at L = {L}")
    _save(plt, fig, path, dpi=110)


def write_report(results: list[dict], out: Path, header: dict) -> dict:
    """Write every figure and report.md into `out`; returns {name: path} of what was written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = {"vanishing": "vanishing.png", "variance": "variance.png", "distance": {}, "separability": {},
               "gradient": {}, "heads": {}}
    plot_vanishing(results, out / figures["vanishing"])
    plot_variance(results, out / figures["variance"])
    for r in results:
        slug = _slug(r["label"])
        for kind, plot in (("distance", plot_distance), ("separability", plot_separability),
                           ("gradient", plot_gradient), ("heads", plot_heads)):
            figures[kind][r["label"]] = f"{kind}_{slug}.png"
            plot(r, out / figures[kind][r["label"]])
    atomic_write_text(out / "report.md", markdown(results, header, figures))
    return figures


def rerender(out: Path) -> dict:
    """Rewrite report.md and the figures of `out` from its diagnose.json (no model needed)."""
    saved = json.loads((Path(out) / "diagnose.json").read_text())
    return write_report(saved["models"], out, saved["header"])


if __name__ == "__main__":  # python -m retrofit.diagnose.figures diag/
    import sys

    rerender(Path(sys.argv[1]))
