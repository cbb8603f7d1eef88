"""report.md from diagnose results: the run, the headlines against the paper, one section per measure."""

from __future__ import annotations

import math

from ..io.escape import md_code, md_inline, md_text

PAPER = {"critical_fraction": 0.06, "plateau": (0.70, 0.85)}  # the paper's GPT-2 numbers


def _fmt(v, digits=3):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def _ratio(a, b):
    return None if a is None or not b else a / b


def _table(head, rows):
    """A markdown table; text cells escaped (a label from diagnose.json is text: retrofit.io.escape.md_inline)."""
    lines = ["| " + " | ".join(map(md_inline, head)) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else md_inline(c) for c in row) + " |"
                    for row in rows]


def markdown(results: list[dict], header: dict, figures: dict) -> str:
    """report.md: what was run, the headlines against the paper, then one section per measure."""
    md = _intro(results, header) + _headlines(results) + _vanishing(results, figures) + _variance(results, figures)
    md += _layers(results, figures) + _distance(results, figures) + _separability(results, figures)
    md += _gradient(results, figures)
    return "\n".join(md)


def _intro(results, header):
    md = ["# retrofit diagnose", "", md_code(header.get("command", "retrofit diagnose")), "",
          f"Data: {md_code(header.get('data'))} ({md_inline(header.get('tokens', '?'))} tokens), "
          f"{md_inline(header.get('windows'))} windows; "
          f"per length L the last {results[0]['queries'][str(results[0]['lengths'][-1])]} query rows before L. "
          "x_i of the paper = the head's value vectors (Theorem 2: scaled to the unit sphere). "
          "Numbers are medians across all (layer, head) pairs unless said otherwise.", ""]
    md += _table(["model", "source", "norm", "layers x heads", "how the measures read for this norm"],
                 [[r["label"], r.get("source", ""), r.get("norm") or "none (softmax)",
                   f"{r['layers']} x {r['heads']}", r["generalization"]] for r in results])
    return md


def _headlines(results):
    md = ["", "## Headlines against the paper", ""]
    rows = []
    for r in results:
        s, Ls = r["summary"], r["lengths"]
        lo, hi = str(Ls[0]), str(Ls[-1])
        crit, g = s["distance"]["critical"][hi], s["gradient"]["by_eps"].get("0.001", {})
        rows.append([r["label"],
                     f"{_fmt(crit['printed']['fraction'])} (median {_fmt(s['distance']['critical_fraction_printed'])})",
                     f"{_fmt(crit['exact']['fraction'])} (median {_fmt(s['distance']['critical_fraction_exact'])})",
                     s["separability"]["plateau"], g.get("slope_small_T_max"),
                     s["vanishing"][hi]["entropy"] / math.log(int(hi)),
                     _ratio(s["variance"][hi]["var_out"], s["variance"][lo]["var_out"]),
                     _ratio(s["variance"][hi]["var_out_raw"], s["variance"][lo]["var_out_raw"])])
    Lmax = results[0]["lengths"][-1]
    md += _table(["model", f"critical N / L at L={Lmax}, printed E", "… exact E", "N_s/N plateau (N ≥ 16)",
                  "1/T slope of max g (ε=1e-3)", f"entropy / log L at L={Lmax}",
                  f"Var out, L={Lmax} / L={results[0]['lengths'][0]}", "Var A·V, same ratio"], rows)
    md += ["", f"Paper (GPT-2): critical N ≈ {PAPER['critical_fraction']}·L; N_s/N plateau "
           f"{PAPER['plateau'][0]}–{PAPER['plateau'][1]}; g ∝ 1/T (slope −1) for T < 0.1. The medians of "
           "critical N / L are over the lengths where the KS test found one.", ""]
    return md


def _vanishing(results, figures):
    labels = [r["label"] for r in results]
    md = ["", "## 1. Vanishing attention (Lemma 1, Corollary 1)", "",
           "Entropy against log L (uniform attention), max weight against 1/L; `2Δ/T` is the median exponent "
           "of Corollary 1's bound (1/n)·exp(±2Δ/T), Δ = ‖q‖·max_j‖k_j‖, n the keys a row sees; `used` the "
           "median share of it the largest weight uses, log(n·max a)/(2Δ/T) (≤ 1; every row was checked "
           "inside the bound: `holds`).", ""]
    rows = []
    for L in results[0]["lengths"]:
        row = [str(L), math.log(L)]
        for r in results:
            v = r["summary"]["vanishing"][str(L)]
            row += [v["entropy"], v["max_weight"], v["cor1_exponent"], v["cor1_upper_use"], v["cor1_holds"]]
        rows.append(row)
    head = ["L", "log L"] + [f"{lab}: {c}" for lab in labels for c in ("entropy", "max a", "2Δ/T", "used", "holds")]
    return md + _table(head, rows) + ["", f"![vanishing]({figures['vanishing']})", ""]


def _variance(results, figures):
    labels = [r["label"] for r in results]
    md = ["## 2. Variance collapse (the L2-softmax post)", "",
           "Channel variance of each head's output per token (what AVNorm divides by): `out` is what the "
           "output projection sees (after the norm), `AV` the weighted average before any output norm, "
           "`pred` = Σ a_i² Var(v_i) (= ‖A‖₂²·Var(v) for uncorrelated values of equal variance).", ""]
    rows = []
    for L in results[0]["lengths"]:
        row = [str(L), 1 / L]
        for r in results:
            v = r["summary"]["variance"][str(L)]
            row += [v["sq_norm"], v["var_out"], v["var_out_raw"], v["var_pred"]]
        rows.append(row)
    head = ["L", "1/L"] + [f"{lab}: {c}" for lab in labels for c in ("‖A‖²", "out", "AV", "pred")]
    return md + _table(head, rows) + ["", f"![variance]({figures['variance']})", ""]


def _layers(results, figures):
    L = results[0]["lengths"][-1]
    md = [f"### Per layer at L = {L} (means over the layer's heads)", ""]
    cols = (("entropy", "entropy"), ("sq_norm", "‖A‖²"), ("var_out", "Var out"), ("dist_true", "d̃ (N=5)"),
            ("sep_ratio", "N_s/N"))
    rows = [[str(i)] + [r["summary"]["by_layer"].get(k, [None] * r["layers"])[i] for r in results for k, _ in cols]
            for i in range(max(r["layers"] for r in results)) if all(i < r["layers"] for r in results)]
    md += _table(["layer"] + [f"{r['label']}: {name}" for r in results for _, name in cols], rows)
    return md + [""] + [f"![heads]({figures['heads'][r['label']]})" for r in results] + [""]


def _distance(results, figures):
    labels = [r["label"] for r in results]
    md = ["## 3. Distance (Theorem 1)", "",
           "Critical N: the smallest N at which a two-sample KS test (α = 0.01) cannot tell the per-head true "
           "distances d̃ from the per-head expectations. `printed` compares with Theorem 1.2's main term as "
           "printed, (L−N)/L·Σ‖(a_i + N/(L−1))x_i − x̄‖ (what the paper's Figure 2 follows); `exact` with "
           "the Jensen term of the true random-set expectation, (L−N)/L·Σ‖a_i x_i − N/(L−1)Σ_{j≠i} a_j x_j‖ "
           f"(tested against enumeration). Paper (GPT-2): ≈ {PAPER['critical_fraction']}·L. The search tries "
           "N on a geometric grid up to L − q (q query rows per length, so every row keeps a key outside its "
           "set): a critical N at that end means the two never agree before N ≈ L; – means not even there.", ""]
    rows = []
    for L in results[0]["lengths"]:
        row = [str(L)]
        for r in results:
            c = r["summary"]["distance"]["critical"][str(L)]
            row += [c["printed"]["critical_n"], c["printed"]["fraction"],
                    c["exact"]["critical_n"], c["exact"]["fraction"]]
        rows.append(row)
    md += _table(["L"] + [f"{lab}: {c}" for lab in labels for c in ("N printed", "N/L", "N exact", "N/L")], rows)
    md += [""]
    for r in results:
        d = r["summary"]["distance"]
        md += [f"**{md_text(r['label'])}** — true d̃ / printed E / E_0 / fixed-set bound, N = {d['n']}: " + "; ".join(
            f"L={L}: {_fmt(v['true'])} / {_fmt(v['expected_printed'])} / {_fmt(v['expected'])} / {_fmt(v['bound'])}"
            for L, v in d["by_length"].items()), "",
            f"L = {d['length']}: " + "; ".join(
            f"N={N}: {_fmt(v['true'])} / {_fmt(v['expected_printed'])} / {_fmt(v['expected'])} / {_fmt(v['bound'])}"
            for N, v in d["by_n"].items()), "", f"![distance]({figures['distance'][r['label']]})", ""]
    return md


def _separability(results, figures):
    md = ["## 4. Geometric separability (Theorem 2)", "",
           f"N_s/N at the largest L, r = min over non-selected ‖s − a_i x_i‖. Paper (GPT-2): plateau "
           f"{PAPER['plateau'][0]}–{PAPER['plateau'][1]}. The lower bound holds for every instance; the upper "
           "bound is about random spherical embeddings, so `upper holds` is the fraction of rows under it.", ""]
    for r in results:
        s = r["summary"]["separability"]
        sep = s["by_n"]
        md += [f"**{md_text(r['label'])}** — L = {s['length']}, plateau (median N_s/N over N ≥ 16): "
               f"{_fmt(s['plateau'])}", ""]
        md += _table(["N", "median N_s/N", "q10–q90", "lower (mean)", "upper (mean)", "upper holds"],
                     [[N, v["ratio_quantiles"][2], f"{_fmt(v['ratio_quantiles'][0])}–{_fmt(v['ratio_quantiles'][4])}",
                       v["lower"], v["upper"], v["upper_holds"]] for N, v in sep.items()])
        md += ["", f"![separability]({figures['separability'][r['label']]})", ""]
    return md


def _gradient(results, figures):
    md = ["## 5. Gradient sensitivity (Corollary 3)", "",
           "g(T, ε) = ‖a_T(l + εΔl) − a_T(l)‖/ε for a random unit Δl over the visible keys, l the model's "
           "own scaled logits (T = 1 is the model as it is). `slope` is the log-log slope of the max over heads "
           "for T ≤ 0.1 (the paper: −1, the 1/T law). The paper's bound min{1/(4T), √2} is not the supremum: "
           "two tied weights give ‖J‖₂ = 1/(2T).", ""]
    rows = []
    for r in results:
        g = r["summary"]["gradient"]
        T = g["temperatures"]
        picks = [min(range(len(T)), key=lambda i: abs(math.log(T[i] / t))) for t in (1e-3, 1e-2, 1e-1, 1, 10)]
        for eps, v in g["by_eps"].items():
            rows.append([r["label"], eps] + [v["max"][i] for i in picks]
                        + [v["slope_small_T_max"], v["above_paper_bound"]])
    md += _table(["model", "ε"] + [f"max g, T={_fmt(t)}" for t in (1e-3, 1e-2, 1e-1, 1, 10)] +
                 ["slope (T ≤ 0.1)", "T values above paper bound"], rows)
    return md + [""] + [f"![gradient]({figures['gradient'][r['label']]})" for r in results] + [""]
