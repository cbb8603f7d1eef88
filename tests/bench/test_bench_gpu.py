"""`retrofit bench gpu` and `retrofit bench decode`: the GPU run's orchestration (on CPU, --tiny), its parity suite
(real numbers: a planted wrong kernel fails it), its refusal without CUDA, and the decode benchmark on a tiny folder."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from retrofit.cli import main
from retrofit.norms import patched_norms
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------- bench gpu


def test_a_part_in_its_own_process_keeps_its_rows_or_says_why_it_died(tmp_path):
    """On CUDA each part runs in a child process (a sticky CUDA error ends that part only)."""
    import argparse

    from retrofit.bench import gpu

    args = argparse.Namespace(device="cpu", tiny=True, steps=1, budgets="", model=None, backends=None,
                              impls="sdpa,psoftmax", random_init=False)
    part = gpu._in_child("attention", args)
    assert part["status"] == "ok" and [(r["impl"], r["seq"]) for r in part["results"]] == [
        (i, t) for t in gpu.TINY["seqs"] for i in ("sdpa", "psoftmax")]
    args.model = str(tmp_path / "missing")  # the child refuses it before any part runs
    part = gpu._in_child("finetune", args)
    assert part["status"] == "failed" and "code 2" in part["error"] and "missing" in part["error"]


def test_bench_gpu_without_cuda_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--out", str(out)]) == 2
    assert _one_line(capsys).endswith("no CUDA device: retrofit bench gpu needs an NVIDIA GPU; use --device cpu "
                                      "--tiny to check the orchestration")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_bench_gpu_tiny_on_cpu_end_to_end(tmp_path, capsys):
    from retrofit.bench import gpu, parity

    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--device", "cpu", "--tiny", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu"]  # the temporary folder became --out
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    env = report["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and "triton" in env and env["name"]
    assert report["wall_s"] > 0 and list(report["parts"]) == ["parity", "attention", "finetune", "long", "longest",
                                                               "sequence"]
    sequence = report["parts"].pop("sequence")  # multi-GPU only: one line saying why it did not run
    assert sequence["status"] == "skipped" and sequence["reason"] == "sequence parallelism needs 2+ GPUs, this " \
        "machine has 0" and "skipped: sequence parallelism needs 2+ GPUs" in (out / "report.md").read_text()
    assert all(p["status"] == "ok" and p["seconds"] >= 0 for p in report["parts"].values())

    check = report["parts"]["parity"]
    ran = [r for r in check["checks"] if "skipped" not in r]
    assert check["failed"] == 0 and check["not_run"] == 0 and check["passed"] == len(ran) > 150
    seen = {(r["norm"], r["dtype"], r["case"]) for r in ran}
    assert seen == {(n, d, c) for n in parity.NORMS for d in parity.DTYPES for c in parity.CASES}  # all covered
    for r in ran:
        assert set(r["errors"]) >= {"out", "dq", "dk", "dv"} and r["finite"]
        assert max(r["errors"].values()) <= parity.TOLERANCE[r["dtype"]]
    assert check["worst_error"]["float32"] < 1e-5  # exact math in fp32, not merely "within a loose tolerance"
    assert {r["skipped"] for r in check["checks"] if "skipped" in r} == {
        "the fused CPU kernel computes softmax only (p = 1)"}

    attention = report["parts"]["attention"]
    rows = attention["results"]
    assert [(r["impl"], r["seq"]) for r in rows] == [(i, t) for t in gpu.TINY["seqs"] for i in gpu.TINY["impls"]]
    for r in rows:
        assert "error" not in r and r["dtype"] == "bfloat16" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert r["timing"] == "best, host clock" and len(r["fwd_all_ms"]) == gpu.TINY["repeats"]
    assert attention["dispatch"] == {"softmax": "cpu_fused", "psoftmax": "blockwise", "ssmax": "cpu_fused",
                                     "softmax1": "cpu_fused"}  # what retrofit.kernels picks here, per kernel call

    tune = report["parts"]["finetune"]
    assert [r["norm"] for r in tune["runs"]] == ["unpatched", *patched_norms()] and tune["steps"] == 2
    for r in tune["runs"]:
        assert "error" not in r and r["steps"] == 2 and r["loss_finite"] and r["tokens_per_s"] > 0
        assert all(abs(x - math.log(gpu.TINY_LLAMA["vocab_size"])) < 0.5 for x in r["losses"])  # random tokens

    long = report["parts"]["long"]
    assert [(r["seq_len"], r["norm"]) for r in long["runs"]] == [(t, a) for t in gpu.TINY["long_seqs"]
                                                                 for a in gpu.arms()]
    for r in long["runs"]:  # one sequence of seq_len tokens per step, gradient checkpointing on
        assert "error" not in r and r["tokens_per_step"] == r["seq_len"] and r["loss_finite"]
        assert r["steps"] == gpu.TINY["long_steps"] and r["peak_memory_mb"] > 0

    longest = report["parts"]["longest"]  # every arm at every length (tiny: nothing runs out of memory)
    lengths = [gpu.TINY["long_start"] * 2 ** i for i in range(2)]
    assert [(r["seq_len"], r["norm"]) for r in longest["runs"]] == [(t, a) for t in lengths for a in gpu.arms()]
    for r in longest["runs"]:
        assert "error" not in r and r["steps"] == 2 and r["loss_finite"] and r["peak_memory_mb"] > 0
        assert r["predicted_over_measured"] == round(r["predicted_mb"] / r["peak_memory_mb"], 3)
    assert longest["longest_trained"] == {arm: lengths[-1] for arm in gpu.arms()}
    assert longest["planner_longest_80"] >= longest["planner_longest"] or longest["plan_for"] == "cpu"

    markdown = (out / "report.md").read_text()
    assert "## longest" in markdown and "planner / peak" in markdown and "dispatches these calls" in markdown
    assert "## parity" in markdown and "## attention" in markdown and "## finetune" in markdown
    assert "## long" in markdown and "gradient checkpointing" in markdown
    assert f"{check['passed']} passed, 0 failed" in markdown
    assert markdown in capsys.readouterr().out  # the same report printed


def test_sequence_part_uses_the_most_gpus_that_divide_the_heads():
    from retrofit.bench.gpu_train import sequence_size

    assert sequence_size(8, 9) == 3 and sequence_size(8, 16) == 8 and sequence_size(4, 6) == 3
    assert sequence_size(2, 9) == 0 and sequence_size(1, 4) == 0  # none: the part is skipped, saying why


@pytest.mark.parametrize("plant", ["scaled", "nan-row"])
def test_a_planted_wrong_kernel_fails_parity_and_the_exit_code(plant, monkeypatch, tmp_path):
    """p-softmax's kernel made 5% wrong (or one row NaN): its checks fail, the other norms' still pass, exit 1."""
    import retrofit.kernels as K

    right = K.psoftmax_attention

    def wrong(q, k, v, p=2.0, **kwargs):
        out = right(q, k, v, p, **kwargs)
        if plant == "scaled":
            return out * 1.05  # above every dtype's tolerance
        return out.index_fill(2, torch.tensor([0], device=out.device), math.nan)

    monkeypatch.setattr(K, "psoftmax_attention", wrong)
    out = tmp_path / "gpu"
    assert main(["bench", "gpu", "--device", "cpu", "--tiny", "--parts", "parity", "--out", str(out)]) == 1
    check = json.loads((out / "report.json").read_text())["parts"]["parity"]
    ran = [r for r in check["checks"] if "skipped" not in r]
    failed = {r["norm"] for r in ran if not r["passed"]}
    assert failed == {"softmax", "psoftmax", "psoftmax-p3"}  # every check of the planted kernel ...
    assert all(not r["passed"] for r in ran if r["norm"] in failed)
    assert all(r["passed"] for r in ran if r["norm"] not in failed)  # ... and nothing else
    if plant == "nan-row":
        assert all(not r["finite"] for r in ran if r["norm"] in failed)
    assert "Failed checks" in (out / "report.md").read_text()


def test_parity_past_its_budget_records_checks_as_not_run():
    from retrofit.bench.parity import run_suite

    report = run_suite("cpu", tiny=True, norms=("ssmax",), dtypes=("float32",), budget_s=0)
    assert report["passed"] == 0 and report["not_run"] == len(report["checks"]) > 0


def test_parity_reference_matches_independent_formulas():
    """The suite's float64 reference against SDPA (p = 1) and the textbook p-softmax, causal and GQA."""
    from retrofit.bench.attention import naive_psoftmax
    from retrofit.bench.parity import reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(reference(q, k, v, "psoftmax", p=1.0), sdpa, atol=1e-12)
    naive = naive_psoftmax(q, k, v, 2.0)  # computes in fp32
    assert torch.allclose(reference(q, k, v, "psoftmax", p=2.0), naive, atol=1e-5)
    assert not torch.allclose(reference(q, k, v, "psoftmax", p=3.0), naive, atol=1e-2)  # p matters
    gqa = reference(q, k[:, :2], v[:, :2], "psoftmax", p=1.0)
    assert torch.allclose(gqa, F.scaled_dot_product_attention(q, k[:, :2], v[:, :2], is_causal=True,
                                                              enable_gqa=True), atol=1e-12)
    sink = torch.full((4,), -1e4, dtype=torch.float64)  # a sink at -inf is plain softmax
    assert torch.allclose(reference(q, k, v, "softmax1", sink), sdpa, atol=1e-12)


# ---------------------------------------------------------------- bench decode


def test_bench_decode_tiny_folder_writes_a_row_per_norm(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    results = tmp_path / "results"
    results.mkdir()  # an existing folder: bench-decode.json goes inside
    assert main(["bench", "decode", str(folder), "--prompt-tokens", "24", "--new-tokens", "4", "--repeats", "2",
                 "--threads", "1", "--out", str(results)]) == 0
    result = json.loads((results / "bench-decode.json").read_text())
    assert result["threads"] == 1 and result["prompt_tokens"] == 24 and "random token ids" in result["prompt"]
    rows = {r["norm"]: r for r in result["results"]}
    assert list(rows) == ["unpatched", *patched_norms()]  # every registered norm but the baseline
    assert rows["unpatched"]["ratio"] == 1.0 and "target" not in rows["unpatched"]
    assert rows["psoftmax"]["target"] == 1.15 and rows["psoftmax"]["options"] == {"p": 2.0}
    for name, r in rows.items():
        assert r["prefill_s"] > 0 and r["decode_tokens_per_s"] > 0 and len(r["decode_tokens_per_s_all"]) == 2
        if name != "unpatched":
            assert r["meets_target"] == (r["ratio"] <= r["target"])
    table = capsys.readouterr().out
    assert "| psoftmax p=2 |" in table and "time per token / unpatched" in table


def test_decode_loop_is_greedy_kv_cache_generation():
    """What bench decode times produces the same tokens as transformers' greedy generate, patched or not."""
    import retrofit
    from retrofit.bench.decode import generate

    model = tiny_model("llama")
    prompt = random_ids(1, 12)
    for norm in (None, "psoftmax"):
        if norm:
            retrofit.patch(model, norm)
        prefill, decode, ids = generate(model, prompt, 5)
        expected = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 12:].tolist()
        assert ids == expected and prefill > 0 and decode > 0


def test_bench_decode_out_file_or_folder(tmp_path):
    from retrofit.bench.decode import FILE_NAME, out_path

    assert out_path(tmp_path) == tmp_path / FILE_NAME
    assert out_path(str(tmp_path / "new") + "/") == tmp_path / "new" / FILE_NAME
    assert out_path(tmp_path / "d.json") == tmp_path / "d.json"
