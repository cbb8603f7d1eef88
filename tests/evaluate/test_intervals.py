"""Intervals (#28, #37): t-interval coverage at n = 2 ... 30, Wilson, windows dealt across documents, paired
differences (a model against itself is exactly [0, 0]), reports with ± and ≈, every committed results.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from retrofit.errors import RetrofitError
from retrofit.evaluate import EvalSpec, cut_windows, evaluate_models, paired_comparisons
from retrofit.evaluate.intervals import bounds, covers_zero, mean_interval, plus_minus, proportion_interval
from retrofit.evaluate.report import validate, write_report
from retrofit.evaluate.windows import window_starts
from tests.tiny import VOCAB, tiny_model

ROOT = Path(__file__).parents[2]


def _tokens(n=3000, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DRAWS = 6000  # coverage's standard error at 95%: 0.0028, so +-3 points is ~11 standard errors


def _coverage(draws: np.ndarray, mean: float) -> float:
    """How often mean_interval of each row holds the true mean."""
    return float(np.mean([lo <= mean <= hi for lo, hi in map(mean_interval, draws)]))


@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
def test_mean_interval_covers_a_normal_mean_at_its_level(n):
    """Seeded normal samples of n windows' losses: the interval holds the true mean 95% +- 3 points of the time at
    every n (the expanded bootstrap it replaced: ~50% at n = 2, 73% at n = 3)."""
    draws = np.random.default_rng(2026 + n).normal(3.4, 0.2, (DRAWS, n))
    assert abs(_coverage(draws, 3.4) - 0.95) <= 0.03


@pytest.mark.parametrize("n", [2, 3, 5, 10, 30])
def test_mean_interval_on_heavy_tailed_units_does_not_undercover(n):
    """Student t with 3 df (finite variance, heavy tails): t's interval is slightly conservative, never short.
    Measured 0.952 ... 0.962; an interval that shrank on outliers (the [min, max] at n = 3) would fail."""
    draws = 3.4 + 0.2 * np.random.default_rng(7 + n).standard_t(3, (DRAWS, n))
    assert 0.93 <= _coverage(draws, 3.4) <= 0.98


def test_mean_interval_edges_and_level():
    assert mean_interval([2.5]) is None and mean_interval([]) is None  # n = 1: no variation to use
    assert mean_interval([1.0, 1.0, 1.0]) == (1.0, 1.0)
    lo, hi = mean_interval([3.0, 3.2, 3.1])  # mean 3.1, sd 0.1, t_2 = 4.303
    assert (lo, hi) == pytest.approx((3.1 - 4.3027 * 0.1 / 3 ** 0.5, 3.1 + 4.3027 * 0.1 / 3 ** 0.5), abs=1e-4)
    narrow = mean_interval([3.0, 3.2, 3.1], level=0.5)
    assert lo < narrow[0] < 3.1 < narrow[1] < hi


def test_no_other_interval_code_in_retrofit():
    """Every interval goes through retrofit.evaluate.intervals: no resampling or quantile-interval code elsewhere."""
    for path in (ROOT / "retrofit").rglob("*.py"):
        if path.name == "intervals.py":
            continue
        text = path.read_text().lower()
        for word in ("bootstrap", "stats.t.", "norm.ppf", "wilson("):
            assert word not in text, (path, word)


def test_wilson_against_known_values():
    wilson = proportion_interval
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    assert wilson(10, 10)[0] == pytest.approx(0.7225, abs=1e-4) and wilson(10, 10)[1] == 1.0
    assert wilson(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)  # symmetric about 0.5
    assert wilson(3, 0) is None
    assert covers_zero([-0.1, 0.2]) and not covers_zero([0.01, 0.2]) and covers_zero(None) is None
    assert plus_minus(3.397, [3.376, 3.418], 3) == "3.397 ± 0.021 (n=3)"
    assert plus_minus(3.397, None, 1) == "3.397 (n=1)" and plus_minus(3.397, None) == "3.397"
    assert bounds(0.5, [0.2366, 0.7634], 10) == "0.500 [0.237, 0.763] (n=10)"


def test_capped_windows_are_dealt_across_documents():
    docs = [list(range(k * 1000, k * 1000 + 100)) for k in range(3)]  # 10 windows of 9 + 1 tokens in each
    starts = window_starts(docs, 9, max_tokens=27)  # 3 windows
    assert [d for d, _ in starts] == [0, 1, 2]
    assert [d for d, _ in window_starts(docs, 9, max_tokens=45)] == [0, 0, 1, 1, 2]
    short = [list(range(100)), list(range(1000, 1015)), list(range(2000, 2100))]  # the middle one has 1 window
    assert [d for d, _ in window_starts(short, 9, max_tokens=63)] == [0, 0, 0, 1, 2, 2, 2]
    assert cut_windows(docs, 9, max_tokens=27)[:, 0].tolist() == [0, 1000, 2000]


@pytest.mark.parametrize("max_tokens", [None, 9, 30, 45, 90, 10 ** 6])
def test_one_document_windows_are_unchanged(max_tokens):
    """One document: exactly the evenly spaced subset retrofit has always cut (the formula before #28)."""
    doc, length = _tokens(100), 9
    starts = list(range(0, len(doc) - length, length + 1))
    keep = len(starts) if not max_tokens else max(1, min(len(starts), max_tokens // length))
    before = torch.stack([torch.tensor(doc[s:s + length + 1]) for s in (starts[i * len(starts) // keep]
                                                                        for i in range(keep))])
    assert torch.equal(cut_windows([doc], length, max_tokens), before)


def test_a_model_against_itself_is_exactly_zero(tmp_path):
    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    docs = [_tokens(700, seed=k) for k in range(3)]
    results = evaluate_models([model, model, other], EvalSpec(tokens=docs, lengths=[16, 32], max_tokens=320,
                                                              names=["a", "a2", "b"], progress=False))
    comparisons = results["comparisons"]
    assert comparisons["reference"] == "a" and results["schema"] == "retrofit.eval/2"
    self_rows = [r for r in comparisons["rows"] if r["model"] == "a2"]
    assert [r["length"] for r in self_rows] == [16, 32]
    for r in self_rows:
        assert r["difference"] == 0.0 and r["ci95"] == [0.0, 0.0] and r["paired"] and r["covers_zero"]
    row = results["models"][0]["lengths"][0]
    assert row["windows"] == 20 and row["windows_by_document"] == [7, 7, 6]
    assert row["window_documents"] == [0] * 7 + [1] * 7 + [2] * 6
    assert np.mean(row["window_losses"]) == pytest.approx(row["loss"], rel=1e-9)
    assert row["ci95"] == list(mean_interval(row["window_losses"])) and row["ci95"][0] < row["loss"] < row["ci95"][1]
    b16 = next(r for r in comparisons["rows"] if r["model"] == "b" and r["length"] == 16)
    b_loss = results["models"][2]["lengths"][0]["loss"]
    assert b16["difference"] == pytest.approx(b_loss - row["loss"], abs=1e-9) and b16["ci95"][0] < b16["ci95"][1]
    validate(results)
    write_report(results, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "## Paired differences to a" in md and "+0.000 ± 0.000 (n=20) ≈" in md and "≈: the interval covers 0" in md
    assert f"{row['loss']:.3f} ± {(row['ci95'][1] - row['ci95'][0]) / 2:.3f} (n=20)" in md
    assert "| 16 | 20 | 7 / 7 / 6 |" in md and "Student's t interval" in md
    assert "loss_minus_a" in (tmp_path / "results.csv").read_text()


def test_reference_is_chosen_or_refused_before_anything_loads():
    with pytest.raises(RetrofitError, match=r"^--reference nope is not one of the models: a, b$"):
        evaluate_models(["x", "y"], EvalSpec(tokens=[1, 2], lengths=[8], names=["a", "b"], reference="nope"))
    model = tiny_model("llama", seed=0)
    results = evaluate_models([model, tiny_model("llama", seed=1)],
                              EvalSpec(tokens=_tokens(400), lengths=[16], max_tokens=64, names=["a", "b"],
                                       reference="b", progress=False))
    assert results["comparisons"]["reference"] == "b"
    assert [r["model"] for r in results["comparisons"]["rows"]] == ["a"]


def test_experiment_report_prints_intervals_and_the_paired_gap_to_the_control(tmp_path):
    from retrofit.evaluate.compare import with_comparisons as _with_comparisons
    from retrofit.experiment.report import write_experiment_report
    model = tiny_model("llama", seed=0)
    spec = EvalSpec(tokens=[_tokens(400, seed=k) for k in range(2)], lengths=[16], max_tokens=96,
                    names=["base", "softmax", "avnorm"], progress=False)
    evaluation = evaluate_models([model, model, tiny_model("llama", seed=1)], spec)
    evaluation = _with_comparisons(dict(evaluation, comparisons={"reference": "stale", "rows": []}), "softmax")
    assert evaluation["comparisons"]["reference"] == "softmax"
    assert [r["model"] for r in evaluation["comparisons"]["rows"]] == ["base", "avnorm"]
    results = {"recipe": "r.yaml", "hardware": {}, "wall_time_s": {}, "base": "base", "control": "softmax",
               "arms": {"softmax": {"patch": {"norm": "softmax"}}, "avnorm": {"patch": {"norm": "avnorm"}}},
               "evaluation": evaluation, "reference": None}
    report = write_experiment_report(results, tmp_path).read_text()
    base = evaluation["models"][0]["lengths"][0]
    assert f"| base | norm=softmax (base) | {plus_minus(base['loss'], base['ci95'], base['windows'])} |" in report
    assert "### Gap to `softmax` by length (paired, same windows)" in report
    assert f"| base | +0.000 ± 0.000 (n={base['windows']}) ≈ |" in report and "≈: the interval covers 0" in report
    assert _with_comparisons(dict(evaluation, models=evaluation["models"][:1]), "softmax").get("comparisons") is None


def _row(loss, sha, window_losses=None):
    row = {"length": 16, "loss": loss, "windows": 3, "windows_sha1": sha}
    return row | ({"window_losses": window_losses} if window_losses else {})


def test_models_on_other_windows_are_not_paired():
    results = {"models": [{"name": "a", "lengths": [_row(3.0, "x", [2.9, 3.0, 3.1])]},
                          {"name": "b", "lengths": [_row(3.2, "y", [3.1, 3.2, 3.3])]},
                          {"name": "old", "lengths": [_row(3.1, "x")]}]}
    rows = paired_comparisons(results)["rows"]
    assert [(r["model"], r["paired"], r["ci95"]) for r in rows] == [("b", False, None), ("old", False, None)]
    assert rows[0]["difference"] == pytest.approx(0.2) and "different windows" in rows[0]["reason"]
    assert "no per-window losses" in rows[1]["reason"]
    assert paired_comparisons({"models": results["models"][:1]}) is None  # one model: nothing to compare


def _committed_results() -> list[Path]:
    return sorted((ROOT / "docs" / "results").rglob("results.json"))


def _no_plots(monkeypatch):
    """Reports without drawing their plots (the plots' own tests draw them): each function returns its path."""
    import retrofit.evaluate.report as eval_report
    import retrofit.experiment.report as experiment_report
    for module, name in ((eval_report, "plot_loss_vs_length"), (eval_report, "plot_loss_by_position"),
                         (eval_report, "plot_passkey"), (eval_report, "plot_counting"),
                         (experiment_report, "line_plot")):
        assert callable(getattr(module, name))
        monkeypatch.setattr(module, name, lambda results, path, **kwargs: Path(path))


def test_every_committed_results_json_validates_and_renders(tmp_path, monkeypatch):
    """Results written before intervals (schema /1) are still read, and render without ± or comparisons."""
    from retrofit.experiment.report import write_experiment_report
    _no_plots(monkeypatch)
    paths = _committed_results()
    assert len(paths) >= 10
    for i, path in enumerate(paths):
        results = json.loads(path.read_text())
        out = tmp_path / str(i)
        if results["schema"].startswith("retrofit.experiment/"):
            validate(results["evaluation"])
            out.mkdir()
            text = write_experiment_report(results, out).read_text()
            assert "by context length" in text, path
        else:
            validate(results)
            write_report(results, out)
            text = (out / "results.md").read_text()
            table = text.split("## Loss by context length")[1][:2000] if "## Loss by context length" in text else ""
            if results.get("settings", {}).get("intervals"):  # written with intervals: they are shown
                # a ± wherever some length stands on 2+ windows (n = 1 gives none: the seeds' table has it)
                has_n2 = any(r.get("windows", 0) >= 2 for m in results["models"] for r in m.get("lengths") or [])
                assert "Intervals: 95%" in text and ("±" in table or not has_n2), path
            else:  # written before them: said, and no ± invented
                assert "No intervals" in text and "±" not in table, path


def test_loss_plot_draws_a_band_only_where_there_are_intervals():
    from matplotlib.figure import Figure

    from retrofit.evaluate.report import draw_lines
    ax = Figure().subplots()
    series = {"a": ([16, 32], [3.0, 3.1]), "b": ([16, 32], [3.2, 3.3])}
    draw_lines(ax, series, xlabel="x", ylabel="y", bands={"a": ([16, 32], [2.9, 3.0], [3.1, 3.2]), "b": ([], [], [])})
    (band,) = ax.collections  # one band: a's; b has no interval
    vertices = band.get_paths()[0].vertices
    assert vertices[:, 1].min() == pytest.approx(2.9) and vertices[:, 1].max() == pytest.approx(3.2)


def test_several_references_each_get_their_own_rows_and_table():
    """--reference a,b: every other model is compared with each, rows name their reference, one table each."""
    from retrofit.evaluate.report import comparison_table_markdown

    results = {"schema": "retrofit.eval/2", "models": [
        {"name": n, "lengths": [{"length": 16, "loss": float(i), "windows": 3, "windows_sha1": "s",
                                 "window_losses": [i + 0.1, i - 0.1, i + 0.05 * i]}]}
        for i, n in enumerate(["a", "b", "c"])]}
    comparisons = paired_comparisons(results, "a,c")
    assert comparisons["reference"] == "a" and comparisons["references"] == ["a", "c"]
    pairs = [(r["reference"], r["model"]) for r in comparisons["rows"]]
    assert pairs == [("a", "b"), ("a", "c"), ("c", "a"), ("c", "b")]
    to_c = {r["model"]: r["difference"] for r in comparisons["rows"] if r["reference"] == "c"}
    assert to_c["b"] == pytest.approx(((1.1 - 2.1) + (0.9 - 1.9) + (1.05 - 2.1)) / 3)  # window by window
    with pytest.raises(RetrofitError, match="--reference z is not one of the models: a, b, c"):
        paired_comparisons(results, "a,z")
    full = {**results, "comparisons": comparisons}
    to_a, to_c = comparison_table_markdown(full), comparison_table_markdown(full, "c")
    assert "model − a" in to_a and "| c |" in to_a and "| a |" not in to_a
    assert "model − c" in to_c and "| a |" in to_c and "| c |" not in to_c


def test_max_windows_caps_every_length_the_same_across_documents():
    """--max-windows 3 over 3 documents: one window from each at every length, whatever max_tokens allows."""
    docs = [list(range(d * 1000, d * 1000 + 400)) for d in range(3)]
    for length in (16, 64):
        starts = window_starts(docs, length, max_tokens=10_000, max_windows=3)
        assert [d for d, _ in starts] == [0, 1, 2]
    assert len(window_starts(docs, 64, max_tokens=128, max_windows=3)) == 2  # the smaller cap wins
    assert cut_windows(docs, 16, None, 4).shape == (4, 17)


def test_evaluate_models_compares_with_every_named_reference():
    """EvalSpec(reference='b,a') reaches evaluate_models: rows to b, then to a (the CLI's --reference b,a)."""
    torch.manual_seed(0)
    docs = [list(range(1, 60)), list(range(3, 62))]
    model = tiny_model("llama")
    results = evaluate_models([model, model], EvalSpec(tokens=docs, lengths=[8], names=["a", "b"], reference="b,a",
                                                       progress=False))
    assert results["comparisons"]["references"] == ["b", "a"]
    assert [(r["reference"], r["model"]) for r in results["comparisons"]["rows"]] == [("b", "a"), ("a", "b")]


def _judged_as_committed(results: dict) -> tuple[dict, dict]:
    """(what a committed results.json holds, what rejudge makes of it) for an evaluation or an experiment."""
    from retrofit.evaluate.rejudge import rejudge
    evaluation = results.get("evaluation", results)
    control = results.get("control", "softmax") if "evaluation" in results else None  # as `retrofit report`
    known = control is not None and any(control in (m["name"], m.get("arm")) for m in evaluation["models"])
    return evaluation, rejudge(evaluation, control if known else None)


def test_rejudge_keeps_the_method_where_every_row_stands_on_one_window():
    """One window a model (seeds give the interval): judged, no per-row interval, the method still named."""
    from retrofit.evaluate.rejudge import rejudge
    one = {"schema": "retrofit.eval/2", "settings": {"intervals": "old"}, "models": [
        {"name": n, "lengths": [{"length": 16, "loss": v, "windows": 1, "windows_sha1": "s", "window_losses": [v]}]}
        for n, v in (("a", 3.0), ("b", 3.5))]}
    again = rejudge(one)
    assert again["settings"]["intervals"].startswith("Student's t")
    assert [m["lengths"][0].get("ci95") for m in again["models"]] == [None, None]
    unkept = {"schema": "retrofit.eval/1", "settings": {"intervals": "old"}, "models": [
        {"name": "a", "lengths": [{"length": 16, "loss": 3.0, "windows": 3}]}]}
    assert "intervals" not in rejudge(unkept)["settings"]  # no units kept: nothing was judged


def test_every_committed_result_is_judged_by_mean_interval():
    """The committed reports were regenerated by `retrofit report` (#37): judging them again changes nothing."""
    for path in _committed_results():
        committed, again = _judged_as_committed(json.loads(path.read_text()))
        assert again == committed, path


def test_report_verb_judges_a_folder_again_in_place(tmp_path, capsys):
    from retrofit.cli import main
    folder = tmp_path / "longctx"
    source = ROOT / "docs" / "results" / "smollm2-longctx-intervals" / "results.json"
    results = json.loads(source.read_text())
    results["settings"]["intervals"] = "expanded percentile bootstrap"  # as judged before #37
    row = results["models"][0]["lengths"][0]
    row["ci95"] = [min(row["window_losses"]), max(row["window_losses"])]
    results["comparisons"]["rows"][0]["ci95"] = [-1.0, 1.0]
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
    assert main(["report", str(folder)]) == 2  # a folder without retrofit's marker is the user's: nothing rewritten
    assert "retrofit adopt" in capsys.readouterr().err
    assert json.loads((folder / "results.json").read_text()) == results and not (folder / "results.md").exists()
    assert main(["adopt", str(folder)]) == 0
    assert main(["report", str(folder)]) == 0
    again = json.loads((folder / "results.json").read_text())
    assert again["models"][0]["lengths"][0]["ci95"] == list(mean_interval(row["window_losses"]))
    assert again["comparisons"] == json.loads(source.read_text())["comparisons"]
    assert again["settings"]["intervals"].startswith("Student's t")
    md = (folder / "results.md").read_text()
    assert "(n=3)" in md and (folder / "results.csv").is_file() and (folder / "loss_vs_length.png").is_file()
    assert main(["report", str(folder), "--reference", "yarn4", "--out", str(tmp_path / "vs-yarn")]) == 0
    assert json.loads((tmp_path / "vs-yarn" / "results.json").read_text())["comparisons"]["references"] == ["yarn4"]
    assert main(["report", str(folder), "--reference", "yarn4"]) == 2  # --reference alone: nothing rewritten
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "has no results.json" in capsys.readouterr().err
