"""`retrofit bench`: each benchmark writes its table and JSON, and bad options are one-line errors."""

from __future__ import annotations

import json

import pytest


def _bench_args(*argv):
    import argparse

    from retrofit.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench, parser.parse_args(list(argv))


def test_bench_attention_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench, args = _bench_args("attention", "--seq", "64", "--heads", "2", "--dim", "16", "--impl", "sdpa,psoftmax",
                              "--repeats", "1", "--out", str(out))
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["sdpa", "psoftmax"]
    for r in rows:
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_peak_mb"] is not None
    table = capsys.readouterr().out
    assert "retrofit p-softmax" in table and "fwd+bwd / sdpa" in table


@pytest.mark.parametrize("argv, message", [
    (["nope"], "unknown benchmark 'nope'"),
    (["attention", "--bogus"], "unrecognized arguments: --bogus"),
    (["attention", "--seq", "12,x"], "--seq must be a comma list"),
    (["attention", "--impl", "sdpa,fast"], "unknown --impl"),
    (["attention", "--p", "0"], "--p must be > 0"),
])
def test_bench_bad_input_is_one_line_error(argv, message):
    from retrofit.errors import RetrofitError

    bench, args = _bench_args(*argv)
    with pytest.raises(RetrofitError, match=message) as err:
        bench.run(args)
    assert "\n" not in str(err.value)


def test_bench_missing_module_is_one_line_error(monkeypatch):
    from retrofit.errors import RetrofitError

    bench, args = _bench_args("later")
    monkeypatch.setitem(bench.BENCHES, "later", "retrofit.bench.not_written_yet")
    with pytest.raises(RetrofitError, match="not available in this build"):
        bench.run(args)


def test_bench_eval_chunked_and_naive_score_the_same_window(tmp_path, capsys):
    out = tmp_path / "bench-eval.json"
    bench, args = _bench_args("eval", "--length", "256", "--out", str(out))
    assert bench.run(args) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"chunked", "naive"}
    assert rows["chunked"]["loss"] == pytest.approx(rows["naive"]["loss"], abs=1e-4)  # same window, same model
    for r in rows.values():
        assert r["peak_memory_mb"] >= r["start_memory_mb"] > 0 and r["tokens_per_s"] > 0
    assert "| chunked | 256 |" in capsys.readouterr().out
