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
    bench, args = _bench_args("attention", "--seq", "64", "--heads", "2", "--dim", "16", "--impl",
                              "sdpa,psoftmax,rowwise", "--repeats", "1", "--out", str(out))
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["sdpa", "psoftmax", "rowwise"]
    for r in rows:
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_peak_mb"] is not None
    table = capsys.readouterr().out
    assert "retrofit p-softmax" in table and "row-wise weights" in table and "fwd+bwd / sdpa" in table


@pytest.mark.parametrize("argv, message", [
    (["nope"], "unknown benchmark 'nope'"),
    (["attention", "--bogus"], "unrecognized arguments: --bogus"),
    (["attention", "--seq", "12,x"], "--seq must be a comma list"),
    (["attention", "--impl", "sdpa,fast"], "unknown --impl"),
    (["attention", "--p", "0"], "--p must be > 0"),
    (["train", "--fsdp"], "--fsdp is measured with --sequence-parallel N > 1"),
    (["train", "--engine", "deepspeed"], "--engine deepspeed is measured with --sequence-parallel N > 1"),
    (["train", "--sequence-parallel", "2", "--seq-len", "129"], "129 is not a multiple of --sequence-parallel 2"),
    (["train", "--sequence-parallel", "3", "--model-type", "llama", "--seq-len", "129"],
     "4 attention heads cannot be split over --sequence-parallel 3"),
])
def test_bench_bad_input_is_one_line_error(argv, message):
    from retrofit.errors import RetrofitError

    bench, args = _bench_args(*argv)
    with pytest.raises(RetrofitError, match=message) as err:
        bench.run(args)
    assert "\n" not in str(err.value)


def test_every_bench_and_command_module_ships():
    """Every benchmark in BENCHES and every verb in the CLI's COMMANDS is a module that imports and provides
    add_arguments/run (so neither the CLI nor `retrofit bench` carries a "not available in this build" fallback)."""
    import importlib

    from retrofit.cli import COMMANDS
    from retrofit.commands import bench

    for name, module_name in bench.BENCHES.items():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), name
    for name, (module_name, _) in COMMANDS.items():
        module = importlib.import_module(module_name)
        add, run = getattr(module, "CLI_COMMANDS", {}).get(name, (getattr(module, "add_arguments", None),
                                                                    getattr(module, "run", None)))
        assert callable(add) and callable(run), name


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


def test_bench_train_memory_labels_the_model_it_measured(tmp_path):
    """Issue 55: rows of `--memory --model SmolLM2` were labelled model_type 'gpt2' (--model-type's default, which
    --model replaces). The child's row names the loaded model's type; the spec, none."""
    import argparse

    from retrofit.bench import train as bench_train
    from retrofit.bench import train_memory
    from tests.tiny import tiny_model

    tiny_model("llama").save_pretrained(tmp_path / "m")
    parser = argparse.ArgumentParser()
    bench_train.add_arguments(parser)  # `retrofit bench train`'s options, --memory's among them
    args = parser.parse_args(["--memory", "--model", str(tmp_path / "m"), "--threads", "1", "--batch", "1"])
    assert args.model_type == "gpt2"  # the CLI's default: what the old rows carried
    spec = train_memory._spec(args, "retrofit", 16) | {"steps": 2}
    assert spec["model_type"] is None
    train_memory.child(spec, tmp_path / "row.json")
    row = json.loads((tmp_path / "row.json").read_text())
    assert row["model_type"] == "llama" and row["model"] == str(tmp_path / "m") and row["peak_mb"] > 0


def test_bench_train_sequence_parallel_deepspeed_runs_alst_over_zero3(tmp_path, capsys):
    """`retrofit bench train --sequence-parallel 2 --engine deepspeed` on a tiny Llama: one process, then two
    processes under torchrun whose runs record DeepSpeed ZeRO-3 sharing each row (ALST); a table and its JSON."""
    from retrofit.cli import main
    out = tmp_path / "sp.json"
    code = main(["bench", "train", "--sequence-parallel", "2", "--engine", "deepspeed", "--model-type", "llama",
                 "--batch", "1", "--seq-len", "64", "--steps", "2", "--warmup", "1", "--threads", "1", "--out",
                 str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["engine"] == {"name": "deepspeed", "world": 2, "backend": "gloo", "nodes": 1, "stage": 3,
                                "sequence_parallel": 2}
    assert [r["rank"] for r in result["processes"]] == [0, 1] and result["one_process"]["engine"]["name"] == "single"
    assert "(DeepSpeed ALST + ZeRO-3)" in capsys.readouterr().out
