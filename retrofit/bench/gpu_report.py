"""The markdown half of `retrofit bench gpu`'s report: one section per part, from the report's JSON alone."""

from __future__ import annotations

from ..evaluate.report import markdown_table
from .attention import label


def _g(x) -> str:
    return "" if x is None else f"{x:.2g}"


def _count(n) -> str:
    return "none" if not n else f"{n:,}"


def _ratio(x, base) -> str:
    return f"{x / base:.2f}x" if x is not None and base else ""


def _parity(part: dict) -> list[str]:
    rows = part["checks"]
    groups = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["backend"]), []).append(r)
    table = []
    for (dtype, backend), group in groups.items():
        ran = [r for r in group if "skipped" not in r and "not_run" not in r]
        worst = max((max(r["errors"].values()) for r in ran if "errors" in r), default=None)
        table.append([dtype, backend, sum(r["passed"] for r in ran), sum(not r["passed"] for r in ran),
                      sum("skipped" in r for r in group), _g(worst), _g(part["tolerance"][dtype])])
    lines = [f"{part['passed']} passed, {part['failed']} failed, {part['skipped']} skipped (backend cannot take "
             f"the inputs), {part['not_run']} not run (over the time budget); error = max|x - ref| / max|ref| "
             f"over out and every gradient, float64 reference; "
             f"cases: {', '.join(part['cases'])}; norms: {', '.join(part['norms'])}.", "",
             markdown_table(["dtype", "backend", "passed", "failed", "skipped", "worst error", "tolerance"], table)]
    failed = [r for r in rows if "skipped" not in r and "not_run" not in r and not r["passed"]]
    if failed:
        lines += ["", "Failed checks" + (f" (first 20 of {len(failed)})" if len(failed) > 20 else "") + ":", ""]
        lines += [f"- {r['norm']} {r['dtype']} {r['case']} {r['backend']}: "
                  + (r.get("error") or ", ".join(f"{k} {_g(v)}" for k, v in r["errors"].items())
                     + ("" if r["finite"] else " (not finite)")) for r in failed[:20]]
    return lines


def _attention(part: dict) -> list[str]:
    rows = part["results"]
    table = []
    for r in rows:
        base = next((b for b in rows if b["impl"] == "sdpa" and b["seq"] == r["seq"] and "fwd_ms" in b), {})
        note = r.get("error") or r.get("skipped") or ""
        table.append([label(r["impl"]), r["seq"], r["batch"], r.get("fwd_ms"),
                      _ratio(r.get("fwd_ms"), r.get("fwd_sdpa_ms")),
                      r.get("fwd_bwd_ms"), _ratio(r.get("fwd_bwd_ms"), r.get("fwd_bwd_sdpa_ms")),
                      r.get("fwd_bwd_peak_mb"), _ratio(r.get("fwd_bwd_peak_mb"), base.get("fwd_bwd_peak_mb")), note])
    header = ["implementation", "T", "B", "fwd ms", "fwd / sdpa", "fwd+bwd ms", "fwd+bwd / sdpa", "peak MB fwd+bwd",
              "peak / sdpa", "note"]
    timing = next((r["timing"] for r in rows if "timing" in r), "the best of the repeats")
    lines = [f"Causal, {part['dtype']}, H x D from the first row, p = {part['p']:g} for p-softmax; SDPA backend: "
             f"{part['sdpa_backend']}; times: {timing} of the repeats, each paired with an SDPA run.", "",
             markdown_table(header, table)]
    if part.get("dispatch"):
        lines += ["", "retrofit.kernels dispatches these calls (bf16, causal, no mask) to: "
                  + ", ".join(f"{key} -> {backend}" for key, backend in part["dispatch"].items()) + "."]
    return lines


def _finetune(part: dict) -> list[str]:
    runs = part["runs"]
    base = next((r.get("tokens_per_s") for r in runs if r["norm"] == "unpatched"), None)
    table = [[r["norm"], r.get("tokens_per_s"), _ratio(base, r.get("tokens_per_s")),
              (r.get("losses") or [None])[0], (r.get("losses") or [None])[-1], r.get("loss_finite"),
              r.get("peak_memory_mb"), r.get("error") or r.get("skipped") or ""] for r in runs]
    header = ["norm", "tokens/s", "time / unpatched", "first loss", "last loss", "loss finite", "peak MB", "note"]
    return [f"{part['model']} ({part['model_type']}), {part['precision']}, {part['steps']} steps of "
            f"{part['batch']} x {part['seq_len']} tokens, {part['data']}.", "", markdown_table(header, table)]


def _long(part: dict) -> list[str]:
    runs = part["runs"]
    table = []
    for r in runs:
        base = next((b.get("tokens_per_s") for b in runs if b["norm"] == "unpatched" and b["seq_len"] == r["seq_len"]),
                    None)
        table.append([r["seq_len"], r["norm"], r.get("tokens_per_s"), _ratio(base, r.get("tokens_per_s")),
                      r.get("peak_memory_mb"), r.get("loss_finite"), r.get("error") or r.get("skipped") or ""])
    header = ["T", "norm", "tokens/s", "time / unpatched", "peak MB", "loss finite", "note"]
    return [f"{part['model']} ({part['model_type']}), {part['precision']}, {part['steps']} steps of one sequence, "
            f"gradient checkpointing, loss {part['loss']}, {part['data']}.", "", markdown_table(header, table)]


def _longest(part: dict) -> list[str]:
    table = [[r["seq_len"], r["norm"], r.get("peak_memory_mb"), r.get("predicted_mb"), r.get("predicted_over_measured"),
              r.get("step_s"), r.get("loss_finite"), r.get("error") or r.get("skipped") or ""] for r in part["runs"]]
    header = ["T", "norm", "peak MB", "planner MB", "planner / peak", "step s", "loss finite", "note"]
    trained = ", ".join(f"{arm} {_count(T)}" for arm, T in part["longest_trained"].items())
    return [f"{part['model']} ({part['model_type']}), {part['precision']}, batch 1, {part['steps']} steps, gradient "
            f"checkpointing, {part['data']}; planner: `retrofit train --dry-run --plan-for {part['plan_for']}` on "
            f"the same recipe. Longest trained: {trained}. The planner's longest fitting length: "
            f"{_count(part['planner_longest'])} here, {_count(part['planner_longest_80'])} on 80 GiB.", "",
            markdown_table(header, table)]


def _sequence(part: dict) -> list[str]:
    one, many = part["one_process"], part["processes"]
    table = [[1, one["peak_mb"], one["tokens_per_s"]], [part["sequence_parallel"], max(r["peak_mb"] for r in many),
                                                        many[0]["tokens_per_s"]]]
    return [f"{part['model']}, {part['precision']}, one sequence of {part['seq_len']} tokens, Ulysses + FSDP2 over "
            f"{part['sequence_parallel']} of {part['gpus']} GPUs: peak per GPU {part['peak_ratio']}x one GPU's "
            f"(target <= {part['target']}x).", "", markdown_table(["GPUs", "peak MB / GPU", "tokens/s"], table)]


KEYS = {"attention": ("sdpa_backend", "dtype"), "finetune": ("model", "model_type", "precision", "steps", "batch",
                                                             "seq_len", "data"),
        "long": ("model", "model_type", "precision", "steps", "loss", "data"),
        "longest": ("model", "model_type", "precision", "steps", "data", "plan_for", "planner_longest",
                    "planner_longest_80")}
SECTIONS = {"parity": _parity, "attention": _attention, "finetune": _finetune, "long": _long, "longest": _longest,
            "sequence": _sequence}


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# retrofit bench gpu" + (" (--tiny)" if report["tiny"] else ""), "",
             f"{env['name']} ({env['device']}"
             + (f", driver {env.get('driver')}, CUDA {env['cuda']}, {env.get('memory_gib')} GiB" if env["device"] ==
                "cuda" else f", {env.get('threads')} threads")
             + f"); torch {env['torch']}, Triton {env['triton']}, transformers {env['transformers']}. "
             f"Wall time {report.get('wall_s')} s.", "",
             markdown_table(["part", "status", "seconds", "error"],
                            [[name, p["status"], p.get("seconds"), p.get("error", "")]
                             for name, p in report["parts"].items()])]
    for name, part in report["parts"].items():
        lines += ["", f"## {name}", ""]
        if part["status"] == "skipped":
            lines += [f"skipped: {part['reason']}"]
            continue
        if part["status"] != "ok":
            lines += [f"failed: {part['error']}", ""]
        if part["status"] == "ok" or part.get("results") or part.get("runs") or part.get("checks"):  # measured rows
            lines += SECTIONS[name](dict(part, **{k: part.get(k, "?") for k in KEYS.get(name, ())}))
    return "\n".join(lines) + "\n"
