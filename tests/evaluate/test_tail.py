"""The AVnorm post's metric (retrofit.evaluate.tail, issue 55): the loss in the last position bucket [L/2, L), its
rise from [L/4, L/2) paired within windows, by model and over seeds; known answers, the per-token losses of a
full forward, and the causality that lets a length-L window stand for one long forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from retrofit.evaluate import EvalSpec, evaluate_models
from retrofit.evaluate.report import results_markdown, validate
from retrofit.evaluate.scoring import token_losses
from retrofit.evaluate.seeds import seed_summary
from retrofit.evaluate.tail import seed_tail_table, tail_buckets, tail_cells, window_tails
from retrofit.evaluate.windows import stack_windows
from tests.tiny import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _t(values) -> tuple[float, float]:
    """The 95% Student-t interval of the mean, written out here (not retrofit's mean_interval)."""
    x = np.asarray(values, dtype=np.float64)
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size)
    return x.mean() - half, x.mean() + half


def test_buckets_and_window_means_are_known_answers():
    assert tail_buckets(256) == [[64, 128], [128, 256]] and tail_buckets(8) == [[2, 4], [4, 8]]
    assert tail_buckets(300) == [[128, 256], [256, 300]]  # not a power of two: the last log-spaced bucket
    losses = torch.arange(8, dtype=torch.float32).repeat(3, 1) + torch.tensor([[0.0], [1.0], [2.0]])  # loss = p + w
    assert window_tails(losses).tolist() == [[2.5, 5.5], [3.5, 6.5], [4.5, 7.5]]


def test_cells_give_the_last_bucket_and_the_paired_rise_with_t_intervals():
    tails = [[1.0, 1.5], [2.0, 2.2], [1.5, 2.4], [1.2, 1.3]]
    cells = tail_cells({"tail_buckets": [[4, 8], [8, 16]], "window_tails": tails})
    last, rise = [t[1] for t in tails], [t[1] - t[0] for t in tails]
    assert cells["bucket"] == [8, 16] and cells["windows"] == 4
    assert cells["loss"] == pytest.approx(np.mean(last)) and cells["ci95"] == pytest.approx(list(_t(last)))
    assert cells["rise"] == pytest.approx(np.mean(rise)) and cells["rise_ci95"] == pytest.approx(list(_t(rise)))
    assert tail_cells({"window_losses": [1.0, 2.0]}) is None  # results written before the metric: nothing claimed


def _documents(n=3, length=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def test_evaluation_keeps_each_windows_tail_means_of_its_full_forward(tmp_path):
    model, docs = tiny_model("llama"), _documents()
    results = evaluate_models([model], EvalSpec(tokens=docs, lengths=[16, 32], max_tokens=320, progress=False))
    validate(results)
    for row in results["models"][0]["lengths"]:
        n = row["length"]
        windows = stack_windows(docs, [(d, s) for d, s in _starts(row, docs)], n)
        with torch.no_grad():  # the whole (B, L) forward's logits, then each position's cross-entropy
            logits = model(input_ids=windows[:, :-1]).logits.double()
            per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
        want = [[per_token[i, a:b].mean().item() for a, b in tail_buckets(n)] for i in range(windows.shape[0])]
        assert row["tail_buckets"] == tail_buckets(n)
        np.testing.assert_allclose(row["window_tails"], want, rtol=1e-5, atol=1e-5)
    md = results_markdown(results)
    assert "## Loss in the last position bucket (the AVnorm post's metric)" in md and "| 32 [16, 32) |" in md


def _starts(row, docs):
    from retrofit.evaluate.windows import window_starts

    return window_starts(docs, row["length"], 320)


def test_a_length_L_window_gives_what_one_longer_forward_gives_on_its_positions():
    """Causal: positions [L/2, L) of a window of L tokens score as in a forward of 4L tokens from the same start,
    which is why each length's own windows stand for the post's one long forward."""
    model, doc = tiny_model("llama"), torch.tensor(_documents(1, 200)[0])
    short, long = token_losses(model, doc[None, :17]), token_losses(model, doc[None, :65])  # L = 16 and 64
    torch.testing.assert_close(short[:, 8:16], long[:, 8:16], atol=1e-5, rtol=1e-5)


def _seeded(arm, seed, tails, sha="w"):
    return {"name": f"{arm}-seed{seed}", "arm": arm, "seed": seed, "model_type": "llama",
            "lengths": [{"length": 16, "loss": 0.0, "windows": len(tails), "windows_sha1": sha,
                         "tail_buckets": [[4, 8], [8, 16]], "window_tails": tails}]}


def test_over_seeds_the_difference_is_paired_within_each_seed_then_t_over_seeds():
    control = {0: [[1.0, 1.1], [1.2, 1.4]], 1: [[1.1, 1.0], [0.9, 1.3]], 2: [[1.0, 1.2], [1.0, 1.1]]}
    arm = {0: [[1.0, 1.6], [1.3, 1.5]], 1: [[1.2, 1.3], [1.0, 1.2]], 2: [[1.1, 1.5], [1.0, 1.6]]}
    results = {"models": [_seeded("softmax", s, t) for s, t in control.items()]
               + [_seeded("avnorm", s, t) for s, t in arm.items()]}
    per_seed = [np.mean([a[1] - c[1] for a, c in zip(arm[s], control[s])]) for s in (0, 1, 2)]
    lo, hi = _t(per_seed)
    sections = dict(seed_tail_table(results, "softmax"))
    table = sections["Last-bucket difference to softmax over seeds"]
    assert lo < 0 < hi and f"| avnorm | +{np.mean(per_seed):.3f} ± {(hi - lo) / 2:.3f} (n=3) ≈ |" in table
    rises = [np.mean([w[1] - w[0] for w in arm[s]]) for s in (0, 1, 2)]
    assert f"+{np.mean(rises):.3f} ± {(_t(rises)[1] - _t(rises)[0]) / 2:.3f} (n=3)" in \
        sections["Rise into the last bucket over seeds"]
    # runs on other windows are not paired: no difference is claimed for them
    results["models"][-1] = _seeded("avnorm", 2, arm[2], sha="other")
    table = dict(seed_tail_table(results, "softmax"))["Last-bucket difference to softmax over seeds"]
    assert "(n=2)" in table and seed_summary(results, "softmax") is not None


def test_with_a_margin_the_last_bucket_difference_gets_its_two_one_sided_tests():
    """The post's metric is a primary endpoint of the fair test: its differences over seeds are judged against the
    declared margin like the window means (≡ only when the 90% t interval lies inside ±margin)."""
    control = {s: [[1.0, 1.0 + 0.01 * s], [1.0, 1.2]] for s in range(4)}
    close = {s: [[1.0, w[1] + 0.004 + 0.001 * s] for w in t] for s, t in control.items()}  # +0.0055 ± 0.002
    far = {s: [[1.0, w[1] + 0.03 + 0.001 * s] for w in t] for s, t in control.items()}   # +0.0315: beyond ±0.02
    results = {"settings": {"equivalence_margin": 0.02},
               "models": [_seeded("softmax", s, t) for s, t in control.items()]
               + [_seeded("close", s, t) for s, t in close.items()] + [_seeded("far", s, t) for s, t in far.items()]}
    table = dict(seed_tail_table(results, "softmax"))["Last-bucket difference to softmax over seeds"]
    close_row = next(line for line in table.splitlines() if line.startswith("| close |"))
    far_row = next(line for line in table.splitlines() if line.startswith("| far |"))
    assert close_row.endswith("(n=4) ≡ |") and "≡" not in far_row and "equivalent within ±0.02" in table
    del results["settings"]  # no margin declared: nothing is called equivalent
    table = dict(seed_tail_table(results, "softmax"))["Last-bucket difference to softmax over seeds"]
    assert "≡" not in table
