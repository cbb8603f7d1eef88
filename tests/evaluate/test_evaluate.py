"""retrofit.evaluate: chunked loss parity, windows, determinism, errors, the CLI. Tiny models, no network."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import retrofit
from retrofit import evaluate
from retrofit.errors import RetrofitError
from retrofit.evaluate import EvalSpec, cut_windows, evaluate_models, parse_lengths, position_buckets, token_losses
from tests.tiny import VOCAB, tiny_model


def _tokens(n=3000, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full_logits_losses(model, windows):
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits.float()  # (B, L, V): the naive reference
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(windows.shape[0], -1)


@pytest.mark.parametrize("model_type,overrides", [("gpt2", {}), ("llama", {}),
                                                  ("gemma2", {"final_logit_softcapping": 3.0})])
@pytest.mark.parametrize("chunk_tokens", [7, 1024])
def test_chunked_loss_equals_full_logits_loss(model_type, overrides, chunk_tokens):
    model = tiny_model(model_type, **overrides)
    windows = torch.tensor(_tokens(3 * 49)).view(3, 49)  # (B, L + 1) with L = 48: chunks do not divide it
    chunked = token_losses(model, windows, chunk_tokens=chunk_tokens)
    assert chunked.shape == (3, 48)
    torch.testing.assert_close(chunked, _full_logits_losses(model, windows), atol=1e-5, rtol=1e-5)


def test_unknown_logit_transform_is_refused(monkeypatch):
    model = tiny_model("gemma2", final_logit_softcapping=3.0)
    monkeypatch.setattr(retrofit.logit_head, "LOGIT_TRANSFORMS", {})  # the head evaluate and distill share
    with pytest.raises(RetrofitError, match="LOGIT_TRANSFORMS"):
        evaluate.check_head(model, torch.tensor([_tokens(16)]))


def test_parse_lengths():
    assert parse_lengths("256,512,...,65536") == [2 ** k for k in range(8, 17)]
    assert parse_lengths("64, 16,32") == [16, 32, 64]
    assert parse_lengths("3,9,...,81") == [3, 9, 27, 81]
    for bad in ["256,512,...,1000", "256,...,1024", "a,b", "", "1"]:
        with pytest.raises(RetrofitError):
            parse_lengths(bad)


def test_windows_are_non_overlapping_deterministic_and_evenly_capped():
    docs = [list(range(100)), list(range(1000, 1050))]
    windows = cut_windows(docs, 9)  # 10 tokens each: 10 from the first document, 5 from the second
    assert windows.shape == (15, 10)
    assert len({t for w in windows.tolist() for t in w}) == 150  # no token used twice
    assert torch.equal(windows, cut_windows(docs, 9))
    capped = cut_windows(docs, 9, max_tokens=45)  # 5 windows, spread over both documents
    assert capped.shape == (5, 10) and capped[-1, 0] >= 1000
    assert position_buckets(16) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16)]
    assert position_buckets(12)[-1] == (8, 12)


def test_same_windows_for_every_model_and_deterministic():
    models = [tiny_model("llama", seed=0), tiny_model("gpt2", seed=1)]
    kwargs = dict(tokens=_tokens(), lengths="16,32,64", train_len=32, max_tokens=500, progress=False)
    first = evaluate_models(models, EvalSpec(**kwargs))
    second = evaluate_models(models, EvalSpec(**kwargs))
    for length_index in range(3):
        digests = {m["lengths"][length_index]["windows_sha1"] for m in first["models"]}
        assert len(digests) == 1
    strip = [[{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s", "peak_memory_mb", "start_memory_mb")}
              for r in m["lengths"]] for m in first["models"]]
    assert strip == [[{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s", "peak_memory_mb",
                                                               "start_memory_mb")} for r in m["lengths"]]
                     for m in second["models"]]
    row = first["models"][0]["lengths"][0]
    assert row["windows"] == 31 and row["tokens"] == 31 * 16
    assert sum(b["tokens"] for b in row["by_position"]) == row["tokens"]
    by_tokens = sum(b["loss"] * b["tokens"] for b in row["by_position"]) / row["tokens"]
    assert by_tokens == pytest.approx(row["loss"], rel=1e-9)
    assert [r["beyond_max_positions"] for r in first["models"][0]["lengths"]] == [False, False, False]


def test_evaluate_lengths_takes_flat_tokens_or_documents():
    model, tokens = tiny_model("llama"), _tokens(500)
    flat = evaluate.evaluate_lengths(model, tokens, [16], max_tokens=64, progress=False)
    as_tensor = evaluate.evaluate_lengths(model, torch.tensor(tokens), [16], max_tokens=64, progress=False)
    as_documents = evaluate.evaluate_lengths(model, [tokens], [16], max_tokens=64, progress=False)
    assert flat[0]["loss"] == as_tensor[0]["loss"] == as_documents[0]["loss"] and flat[0]["windows"] == 4


def _char_tokenizer(text):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=text[0]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_text_is_tokenized_once_per_tokenizer(tmp_path, monkeypatch):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    (tmp_path / "book.txt").write_text(text)
    tokenizer = _char_tokenizer(text)
    folders = []
    for seed in (0, 1):  # two saved models that ship the same tokenizer
        folder = tmp_path / f"model{seed}"
        tiny_model("llama", seed=seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders.append(str(folder))
    calls = []
    real = evaluate.tokenize_files
    monkeypatch.setattr(evaluate.driver, "tokenize_files", lambda tok, paths: calls.append(paths) or real(tok, paths))
    results = evaluate_models(folders, EvalSpec(data=str(tmp_path / "book.txt"), lengths=[32, 64], max_tokens=200,
                                                progress=False))
    assert len(calls) == 1
    assert [m["name"] for m in results["models"]] == ["model0", "model1"]
    assert results["data"]["documents"] == [len(text)]
    assert results["models"][0]["lengths"][0]["windows_sha1"] == results["models"][1]["lengths"][0]["windows_sha1"]


def test_learned_positions_limit_and_nope_way_out():
    model = tiny_model("gpt2")  # 64 learned positions
    with pytest.raises(RetrofitError, match=r"64 tokens.*\[128\].*--nope"):
        evaluate_models([model], EvalSpec(tokens=_tokens(), lengths=[32, 128], progress=False))
    retrofit.patch(model, "softmax", nope=True)
    results = evaluate_models([model], EvalSpec(tokens=_tokens(), lengths=[32, 128], max_tokens=128, progress=False))
    assert results["models"][0]["max_learned_positions"] is None
    assert results["models"][0]["lengths"][1]["beyond_max_positions"]  # n_positions is still 64


def test_bad_input_is_one_line_error(tmp_path):
    with pytest.raises(RetrofitError, match="longest has 100") as err:
        evaluate_models([tiny_model("llama")], EvalSpec(tokens=_tokens(100), lengths=[16, 128], progress=False))
    assert "\n" not in str(err.value)
    (tmp_path / "junk").mkdir()
    with pytest.raises(RetrofitError, match="config.json"):
        evaluate_models([str(tmp_path / "junk")], EvalSpec(tokens=_tokens(), lengths=[16], progress=False))
    (tmp_path / "bad.json").write_text('{"not": "tokens"}')
    with pytest.raises(RetrofitError, match="token ids"):
        evaluate_models([tiny_model("llama")], EvalSpec(data=str(tmp_path / "bad.json"), lengths=[16], progress=False))


def test_cli_writes_report_and_exits_2_without_traceback(tmp_path, capsys):
    folder = tmp_path / "tiny-gpt2"
    tiny_model("gpt2").save_pretrained(folder)
    (tmp_path / "tokens.json").write_text(json.dumps(_tokens(2000)))
    from retrofit.cli import main
    assert main(["eval", str(folder), "--data", str(tmp_path / "tokens.json"), "--lengths", "8,16,...,64",
                 "--train-len", "32", "--max-tokens", "256", "--out", str(tmp_path / "eval"), "--no-progress"]) == 0
    assert (tmp_path / "eval" / "results.json").is_file() and (tmp_path / "eval" / "loss_vs_length.png").is_file()
    assert main(["eval", str(folder), "--data", str(tmp_path / "tokens.json"), "--lengths", "32,64,...,256",
                 "--out", str(tmp_path / "eval2")]) == 2  # 64 learned positions
    assert "64 tokens" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "retrofit", "eval", str(folder),
                           "--data", str(tmp_path / "tokens.json"),
                           "--lengths", "1024,4096", "--out", str(tmp_path / "eval3")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "retrofit eval: error: length 4096 needs 4097 tokens in one document but the longest has 2000: "
        "use shorter --lengths or longer --data"]


def test_passkey_accuracy_matches_full_logits_greedy_check():
    from retrofit.data import PASSKEY_FILLER, PASSKEY_INTRO, PASSKEY_QUESTION, passkey_batch
    tokenizer = _char_tokenizer(PASSKEY_INTRO + PASSKEY_FILLER + PASSKEY_QUESTION + "0123456789 .TheRmbrisky")
    model = tiny_model("llama")
    rows = evaluate.evaluate_passkey(model, tokenizer, [256, 320], depths=(0.0, 1.0), trials=3, batch_tokens=512)
    assert [(r["length"], r["depth"], r["trials"]) for r in rows] == [(256, 0.0, 3), (256, 1.0, 3), (320, 0.0, 3),
                                                                      (320, 1.0, 3)]
    for r in rows:
        batch = passkey_batch(tokenizer, 3, r["length"] + 1, depth=r["depth"], seed=0)
        with torch.no_grad():
            logits = model(batch["input_ids"][:, :-1]).logits  # (3, L, V)
        labels = batch["labels"][:, 1:]
        correct = ((logits.argmax(-1) == labels) | (labels == -100)).all(1)
        assert r["accuracy"] == correct.float().mean().item()
        assert r["correct"] == correct.sum().item()
        assert r["ci95"] == list(evaluate.intervals.proportion_interval(r["correct"], 3))
    results = evaluate_models([model], EvalSpec(tokenizer=tokenizer, lengths=[256], tasks=["passkey"],
                                               passkey={"depths": [0.5], "trials": 2}, progress=False))
    assert results["models"][0]["passkey"][0]["trials"] == 2 and results["models"][0]["lengths"] == []


def test_counting_runs_are_evaluated_on_counting():
    from retrofit.data import counting_batch
    from retrofit.load import CountingModel
    model = CountingModel(tiny_model("llama")).eval()
    results = evaluate_models([model], EvalSpec(lengths=[16, 128], counting={"sequences": 3, "alphabet": 4},
                                               progress=False))
    row = results["models"][0]["counting"][1]
    batch = counting_batch(3, 128, alphabet=4, seed=0)
    with torch.no_grad():
        err = model(batch["input_ids"])[:, 1:] - batch["counts"][:, 1:]
    assert row["l1"] == pytest.approx(err.abs().mean().item(), rel=1e-6)
    assert row["mse"] == pytest.approx(err.pow(2).mean().item(), rel=1e-6)
    assert row["sequence_l1"] == pytest.approx(err.abs().mean(1).tolist(), rel=1e-6)  # one per sequence
    assert row["ci95"] == list(evaluate.intervals.mean_interval(row["sequence_l1"]))
    assert row["by_position"][0]["start"] == 1 and row["by_position"][-1]["end"] == 128
    with pytest.raises(RetrofitError, match="--tasks counting"):
        evaluate_models([model], EvalSpec(tokens=_tokens(), lengths=[16], tasks=["lm"], progress=False))
    with pytest.raises(RetrofitError, match="language model"):
        evaluate_models([tiny_model("llama")], EvalSpec(lengths=[16], tasks=["counting"], progress=False))


def test_no_progress_eval_logs_each_length_and_silences_the_libraries_bars(tmp_path, capfd, monkeypatch):
    """Issue 62: `retrofit eval --no-progress > log` printed nothing until the whole table (16 minutes on SmolLM2),
    and transformers' own bars (GGUF conversion, "Writing model shards") stayed on. Now one line per model x length
    as it finishes, before the table; the libraries' bars are off while the models load and back on after."""
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from retrofit.cli import main
    from retrofit.evaluate import driver
    folder = tmp_path / "tiny-gpt2"
    tiny_model("gpt2").save_pretrained(folder)
    (tmp_path / "tokens.json").write_text(json.dumps(_tokens(2000)))
    bars_during_load = []
    real_load = driver._load
    monkeypatch.setattr(driver, "_load", lambda *a, **k: bars_during_load.append(
        (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled())) or real_load(*a, **k))
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()
    capfd.readouterr()
    assert main(["eval", str(folder), "--data", str(tmp_path / "tokens.json"), "--lengths", "16,32",
                 "--max-tokens", "256", "--out", str(tmp_path / "eval"), "--no-progress"]) == 0
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("tiny-gpt2 L=")]
    assert len(lines) == 2, out
    assert re.fullmatch(r"tiny-gpt2 L=16: loss \d+\.\d{4} ± \d+\.\d{4} \(16 windows, \d+\.\d s\)", lines[0]), lines
    assert out.index(lines[1]) < out.index("| ")  # each length as it finishes, before the table
    assert "it/s" not in err and "%|" not in err  # no bar at all
    assert bars_during_load == [(False, True)]
    assert hf_logging.is_progress_bar_enabled() and not are_progress_bars_disabled()  # as they were, after
