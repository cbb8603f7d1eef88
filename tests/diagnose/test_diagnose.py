"""retrofit diagnose: known answers, the paper's bounds on random instances, the capture seam, the CLI."""

from __future__ import annotations

import itertools
import json
import math
import string

import pytest
import torch

import retrofit
from retrofit import PatchSpec
from retrofit.diagnose import Plan, diagnose
from retrofit.diagnose import measures as M
from retrofit.diagnose.capture import capture_rows
from retrofit.errors import RetrofitError
from retrofit.lengths import parse_lengths
from retrofit.norms import available_norms, get_norm
from tests.tiny import VOCAB, random_ids, randomize_patch, tiny_model

D64 = torch.float64


def _random_rows(seed, rows=3, n=9, dim=4, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, n, generator=g, dtype=D64) * sharp
    x = torch.randn(n, dim, generator=g, dtype=D64)
    return logits, x, torch.ones(rows, n, dtype=torch.bool), g


# ---------------------------------------------------------------- known answers


def test_uniform_attention_gives_log_L_entropy_and_inverse_L_norm():
    L, hidden = 16, 5  # the last 5 keys are hidden from this row
    visible = torch.arange(L + hidden) < L
    w = torch.where(visible, 1.0 / L, 0.0).to(D64)[None]
    stats = M.row_stats(w, visible[None])
    assert stats["entropy"].item() == pytest.approx(math.log(L))
    assert stats["sq_norm"].item() == pytest.approx(1 / L)
    assert stats["max_weight"].item() == pytest.approx(1 / L)
    assert stats["n"].item() == L and stats["mass"].item() == pytest.approx(1.0)


def test_one_hot_pattern_gives_the_distances_computed_by_hand():
    x = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]], dtype=D64)   # four unit vectors, L = 4
    vis = torch.ones(1, 4, dtype=torch.bool)
    one_hot = torch.tensor([[1.0, 0, 0, 0]], dtype=D64)
    d = M.topn_distance(one_hot, x, vis, [1])
    # s = x_0; each other token contributes ||0 - x_0|| = 1.
    assert d["true"].item() == pytest.approx(3.0)
    # bound: rho = 0, max ||x_j|| = 1, abar (L - N) - rho = 3  -> tight here
    assert d["bound"].item() == pytest.approx(3.0)
    # random I_1: {0} gives 3, any other {j} gives ||x_0|| = 1 -> E = (3 + 3) / 4; Jensen's term is exact here
    assert d["expected"].item() == pytest.approx(1.5)
    # the printed main term, 3/4 sum_i ||(a_i + 1/3) x_i - x_0||: i = 0 gives 1/3, x_1 and x_3 give
    # ||(-1, +-1/3)|| = sqrt(10)/3 each, x_2 gives ||(-4/3, 0)|| = 4/3 -- not E
    assert d["expected_printed"].item() == pytest.approx(0.75 * (5 / 3 + 2 * math.sqrt(10) / 3))
    two_hot = torch.tensor([[0.5, 0.5, 0, 0]], dtype=D64)
    d = M.topn_distance(two_hot, x, vis, [2])
    assert d["true"].item() == pytest.approx(2 * math.sqrt(0.5))        # 2 ||(x_0 + x_1) / 2||


def test_separability_by_hand():
    x = torch.tensor([[1.0, 0], [0, 1], [-1, 0], [0, -1]], dtype=D64)
    vis = torch.ones(1, 4, dtype=torch.bool)
    delta = torch.tensor([math.sqrt(2)], dtype=D64)
    s = M.separability(torch.tensor([[0.6, 0.4, 0, 0]], dtype=D64), x, vis, [2], delta)
    r = math.sqrt(0.6 ** 2 + 0.4 ** 2)                 # s = (0.6, 0.4); the others sit at the origin
    assert s["r"].item() == pytest.approx(r)
    assert s["ratio"].item() == 1.0                    # ||a_0 x_0 - s|| = 0.4 and ||a_1 x_1 - s|| = 0.6, both <= r
    # xi_0 = 0.4, xi_1 = 0.6 (no cross terms with N = 2)
    assert s["lower"].item() == pytest.approx(1 - (0.4 + 0.6) / (2 * r))
    expected_upper = (math.exp(-(r - 0.4) ** 2 / 16) + math.exp(-(r - 0.6) ** 2 / 16)) / 2
    assert s["upper"].item() == pytest.approx(expected_upper)


def test_softmax_jacobian_formula_equals_finite_differences():
    logits, _, vis, g = _random_rows(0, rows=2, n=7)
    for T in (0.3, 1.0, 4.0):
        J = M.softmax_jacobian(M.softmax_weights(logits / T), T)                  # (2, 7, 7)
        auto = torch.stack([torch.autograd.functional.jacobian(lambda row_, T=T: torch.softmax(row_ / T, -1), row)
                            for row in logits])
        torch.testing.assert_close(J, auto)
        for _ in range(3):
            dl = M.unit_directions(vis, g)
            fn = lambda scores, t: M.softmax_weights(scores / t)  # noqa: E731
            fd = M.finite_difference_gain(fn, logits, dl, T, 1e-6)
            torch.testing.assert_close(fd, (J @ dl[..., None])[..., 0].norm(dim=-1), rtol=1e-4, atol=1e-9)


def test_jacobian_norm_reaches_half_over_T_not_the_papers_quarter():
    T = 0.5
    tie = torch.tensor([3.0, 3.0, -20.0, -20.0], dtype=D64)        # two tied weights of 1/2
    J = M.softmax_jacobian(M.softmax_weights(tie / T), T)
    norm = torch.linalg.matrix_norm(J, ord=2).item()
    assert norm == pytest.approx(1 / (2 * T), rel=1e-6)
    assert norm > M.corollary3_bound(T).item()                      # Corollary 3's 1/(4T) is exceeded
    for seed in range(20):                                          # ... but 1/(2T) always holds
        logits, _, _, _ = _random_rows(seed, rows=4, n=12, sharp=5.0)
        for T in (0.05, 1.0):
            J = M.softmax_jacobian(M.softmax_weights(logits / T), T)
            assert (torch.linalg.matrix_norm(J, ord=2) <= 1 / (2 * T) + 1e-12).all()


# ---------------------------------------------------------------- bounds on random instances


@pytest.mark.parametrize("norm", ["softmax", "psoftmax", "softmax1", "ssmax"])
def test_corollary1_bounds_hold_on_random_instances(norm):
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        n, d, scale = int(torch.randint(2, 40, (1,), generator=g)), 8, 8 ** -0.5
        q = torch.randn(d, generator=g, dtype=D64) * 3
        k = torch.randn(n, d, generator=g, dtype=D64) * 3
        logits = (k @ q) * scale
        a = q.norm() * k.norm(dim=-1).max() * scale                 # Delta / T
        p, sink = float(1 + 3 * torch.rand(1, generator=g)), torch.randn(1, generator=g, dtype=D64) * 3
        if norm == "softmax":
            w = M.softmax_weights(logits)
        elif norm == "psoftmax":
            w = M.psoftmax_weights(logits, p)
        elif norm == "softmax1":
            w = M.softmax1_weights(logits, sink)
        else:  # ssmax: the caller scales the logits and a by s log n
            factor = float(torch.rand(1, generator=g)) * math.log(n)
            w, a = M.softmax_weights(logits * factor), a * factor
        lo, hi = M.log_weight_bounds(torch.tensor(math.log(n), dtype=D64), a, p=p if norm == "psoftmax" else 1.0,
                                     sink=sink[0] if norm == "softmax1" else None)
        assert (w.log() >= lo - 1e-9).all() and (w.log() <= hi + 1e-9).all(), (seed, norm)


def test_theorem1_bounds_hold_on_random_instances():
    """Fixed-set bound >= d~; E_0 <= E <= E_0 + eps with E enumerated over all subsets (softmax and p-softmax)."""
    for seed in range(12):
        logits, x, vis, g = _random_rows(seed, rows=2, n=7, dim=3)
        for w in (M.softmax_weights(logits), M.psoftmax_weights(logits, 2.0)):
            ns = [1, 2, 3, 5]
            d = M.topn_distance(w, x, vis, ns)
            assert (d["bound"] >= d["true"] - 1e-9).all()
            for r, (gi, N) in itertools.product(range(2), enumerate(ns)):
                subsets = list(itertools.combinations(range(7), N))
                total = 0.0
                for sub in subsets:
                    s = sum(w[r, i] * x[i] for i in sub)
                    total += sum(float((w[r, i] * x[i] - s).norm()) for i in range(7) if i not in sub)
                E = total / len(subsets)
                assert d["expected"][r, gi] - 1e-9 <= E <= d["expected"][r, gi] + d["eps"][r, gi] + 1e-9


def test_theorem2_lower_bound_holds_and_ratio_matches_brute_force():
    for seed in range(12):
        logits, x, vis, _ = _random_rows(seed, rows=3, n=30, dim=6)
        x = x / x.norm(dim=-1, keepdim=True)
        w = M.softmax_weights(logits)
        delta = M.min_pairwise_distance(x)[-1].expand(3)
        ns = [1, 3, 8, 16]
        s = M.separability(w, x, vis, ns, delta)
        assert (s["ratio"] >= s["lower"] - 1e-9).all()
        assert ((s["upper"] > 0) & (s["upper"] <= 1)).all()
        for r, (gi, N) in itertools.product(range(3), enumerate(ns)):
            top = w[r].argsort(descending=True)[:N].tolist()
            ctx = sum(w[r, i] * x[i] for i in top)
            radius = min(float((w[r, i] * x[i] - ctx).norm()) for i in range(30) if i not in top)
            inside = sum(float((w[r, i] * x[i] - ctx).norm()) <= radius for i in top)
            assert s["ratio"][r, gi].item() == pytest.approx(inside / N)


def test_min_pairwise_distance_per_prefix():
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(3), dtype=D64)
    got = M.min_pairwise_distance(x)
    assert math.isinf(got[0])
    for t in range(1, 12):
        brute = min(float((x[i] - x[j]).norm()) for i in range(t + 1) for j in range(i))
        assert got[t].item() == pytest.approx(brute)


def test_predicted_variance_for_uncorrelated_values():
    g = torch.Generator().manual_seed(0)
    w = M.softmax_weights(torch.randn(1, 24, generator=g, dtype=D64))
    values = torch.randn(64, 24, 4096, generator=g, dtype=D64) * 1.7      # 64 draws of 24 iid value vectors
    measured = M.channel_variance(w[None] @ values)                        # (64, 1)
    predicted = M.predicted_output_variance(w, M.channel_variance(values))  # (64, 1)
    assert measured.mean().item() == pytest.approx(predicted.mean().item(), rel=0.03)
    assert predicted.mean().item() == pytest.approx(w.pow(2).sum().item() * 1.7 ** 2, rel=0.03)


def test_critical_n_is_the_first_indistinguishable_N():
    g = torch.Generator().manual_seed(0)
    same = {N: torch.randn(200, generator=g) for N in (1, 2, 4)}
    shifted = {1: same[1] + 5, 2: same[2] + 5, 4: same[4] + 0.01}
    assert M.critical_n(same, shifted)[0] == 4
    assert M.critical_n(same, {N: v + 5 for N, v in same.items()})[0] is None


# ---------------------------------------------------------------- the capture seam


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_capture_sees_every_layer_and_matches_eager_weights(model_type):
    ids = random_ids(2, 24)
    positions = [3, 11, 23]
    eager = tiny_model(model_type, attn_implementation="eager")
    with torch.no_grad():
        reference = eager(input_ids=ids, output_attentions=True, use_cache=False).attentions
    model = tiny_model(model_type)                                  # same seed: same weights, sdpa
    seen = {}
    with capture_rows(model, positions, lambda rows: seen.__setitem__(rows.layer, rows)):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    assert sorted(seen) == list(range(len(reference)))
    for layer, rows in seen.items():
        torch.testing.assert_close(rows.weights, reference[layer][:, :, positions].float(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(rows.head_out, rows.head_out_raw)
    assert model.config._attn_implementation == "sdpa"               # observe switched it back


@pytest.mark.parametrize("norm,options", [(n, get_norm(n).example_options) for n in available_norms()])
def test_rebuilt_weights_match_each_norms_own_output(norm, options):
    """Every registered norm (its example options): the weights diagnose rebuilds from Norm.weights, times the values,
    are the norm's own output (AVNorm: its formula on the softmax output)."""
    model = tiny_model("llama")
    retrofit.patch(model, norm, **options)
    randomize_patch(model, seed=1)  # per-head gain / s / sink: not all equal
    seen = {}
    with capture_rows(model, [5, 15], lambda rows: seen.__setitem__(rows.layer, rows)):
        with torch.no_grad():
            model(input_ids=random_ids(1, 16), use_cache=False)
    for rows in seen.values():
        assert rows.norm == norm
        if norm == "avnorm":   # the norm's output: g_h * o / sqrt(mean_d o^2 + eps), per token and head
            gain = model.model.layers[rows.layer].self_attn.retrofit.gain.view(1, -1, 1, 1)
            raw = rows.head_out_raw
            expected = gain * raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-5)
            torch.testing.assert_close(rows.head_out, expected, rtol=1e-4, atol=1e-5)
        else:                  # the weights diagnose rebuilds reproduce the norm's own kernel output
            torch.testing.assert_close(rows.head_out, rows.head_out_raw, atol=1e-5, rtol=1e-4)
        if norm == "psoftmax":
            torch.testing.assert_close(rows.weights.pow(2).sum(-1), torch.ones(1, 4, 2))


def test_norm_output_on_a_model_patched_over_eager():
    model = tiny_model("gpt2", attn_implementation="eager")
    retrofit.patch(model, "avnorm", kind="layer")
    seen = {}
    with capture_rows(model, [4, 9], lambda rows: seen.__setitem__(rows.layer, rows)):
        with torch.no_grad():
            model(input_ids=random_ids(2, 10), use_cache=False)
    for rows in seen.values():   # per token and head: mean 0, variance 1 (unit gain) after the eager kernel
        raw = rows.head_out_raw - rows.head_out_raw.mean(-1, keepdim=True)
        torch.testing.assert_close(rows.head_out, raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-5),
                                   rtol=1e-4, atol=1e-5)


def test_avnorm_removes_the_variance_collapse():
    model = tiny_model("llama")
    plan = Plan(lengths=[8, 32], queries=4, temperatures=(0.1, 1.0), epsilons=(1e-3,), separability_ns=(1, 4))
    ids = random_ids(2, 32)
    base = diagnose(model, ids, plan, progress=False)["summary"]["variance"]
    retrofit.patch(model, "avnorm", kind="layer")
    patched = diagnose(model, ids, plan, progress=False)["summary"]["variance"]
    assert base[32]["var_out"] < 0.5 * base[8]["var_out"]                  # softmax output variance shrinks ...
    assert patched[32]["var_out_raw"] < 0.01                              # A V before the norm is still small
    assert patched[32]["var_out"] == pytest.approx(1.0, abs=0.01)          # ... AVNorm's stays at gain^2 = 1
    assert patched[8]["var_out"] == pytest.approx(1.0, abs=0.01)


# ---------------------------------------------------------------- bad input and the CLI


def test_bad_input_is_a_one_line_error():
    with pytest.raises(RetrofitError):
        capture_rows(torch.nn.Linear(2, 2), [1], lambda rows: None)
    with pytest.raises(RetrofitError, match="lengths"):
        parse_lengths("32,...,1024")
    assert parse_lengths("32,64,...,256") == [32, 64, 128, 256]
    assert parse_lengths("100,200,...,500") == [100, 200, 300, 400, 500]
    spec = PatchSpec.parse("avnorm:kind=layer,affine=true")
    assert (spec.norm, spec.options) == ("avnorm", {"kind": "layer", "affine": True})
    with pytest.raises(RetrofitError, match="tokens"):
        diagnose(tiny_model("gpt2"), random_ids(1, 16), Plan(lengths=[8, 32]), progress=False)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    """A saved tiny GPT-2 with a character tokenizer of its vocabulary size, and a text file."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("diag")
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tiny_model("gpt2").save_pretrained(root / "gpt2")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(root / "gpt2")
    text = root / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 12)
    return root


def test_cli_writes_the_report_and_refuses_bad_input(tiny_source, tmp_path, capsys):
    from retrofit.cli import main

    src, data, out = str(tiny_source / "gpt2"), str(tiny_source / "text.txt"), tmp_path / "diag"
    rc = main(["diagnose", src, "--data", data, "--lengths", "8,16,...,32", "--windows", "2", "--queries", "2",
               "--patch", "avnorm", "--calibrate-tokens", "64", "--out", str(out), "--quiet"])
    assert rc == 0
    result = json.loads((out / "diagnose.json").read_text())
    labels = [m["label"] for m in result["models"]]
    assert labels == ["gpt2", "gpt2+avnorm"]
    assert result["schema"] == "retrofit.diagnose/1"
    assert result["models"][1]["patch"]["calibration"]["tokens"] == 64
    assert all(len(v) == 2 for v in result["models"][0]["per_head"].values())      # every layer
    for name in ("report.md", "vanishing.png", "variance.png", "distance_gpt2.png", "separability_gpt2+avnorm.png",
                 "gradient_gpt2.png"):
        assert (out / name).is_file(), name
    capsys.readouterr()

    for argv, needle in (([src, "--lengths", "8,...", "--data", data], "--lengths"),
                         ([src, "--lengths", "2048", "--data", data], "tokens"),                # longer than the text
                         ([src, "--lengths", "8,16", "--windows", "99", "--data", data], "tokens"),
                         ([str(tiny_source), "--lengths", "8", "--data", data], "config.json"),  # not a model
                         ([src, "--patch", "avnrm", "--data", data], "avnorm")):
        rc = main(["diagnose", *argv, "--out", str(tmp_path / "bad"), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err and needle in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
