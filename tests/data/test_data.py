"""retrofit.data: generated tasks, packing, validation split, resumable positions, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from retrofit.data import build_data, counting_batch, passkey_batch, passkey_example
from retrofit.errors import RetrofitError
from retrofit.recipe import DataSection
from tests.tiny import char_tokenizer


def lm_section(tmp_path, **kw) -> DataSection:
    return DataSection(**{"task": "lm", "cache_dir": str(tmp_path / "cache"), **kw})


def test_counting_batch_counts_the_target_at_any_length():
    b = counting_batch(3, 1000, alphabet=4, seed=7)
    ids, counts = b["input_ids"], b["counts"]
    assert ids.shape == counts.shape == (3, 1000) and ids.max() < 4
    for row in range(3):
        target = ids[row, 0]
        expected = [0] + torch.cumsum((ids[row, 1:] == target).long(), 0).tolist()
        assert counts[row].long().tolist() == expected
    again = counting_batch(3, 1000, alphabet=4, seed=7)
    assert torch.equal(again["input_ids"], ids)
    assert not torch.equal(counting_batch(3, 1000, alphabet=4, seed=8)["input_ids"], ids)


def test_counting_data_batches_depend_on_step_only():
    data = build_data(DataSection(task="counting", seq_len=16), seed=3)
    a, b = data.batch(5, 4, 16), data.batch(5, 4, 16)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(data.batch(6, 4, 16)["input_ids"], a["input_ids"])
    evals = data.eval_batches(64, 2, 3)
    assert len(evals) == 2 and evals[0]["input_ids"].shape == (3, 64)


def test_passkey_hides_the_key_and_labels_only_the_answer():
    tok = char_tokenizer()
    ex = passkey_example(tok, 300, 0.5, "12345")
    ids, labels = ex["input_ids"], ex["labels"]
    assert ids.shape == labels.shape == (300,)
    answer = labels[labels != -100]
    assert tok.decode(answer).replace(" ", "") == "12345"
    assert torch.equal(ids[-len(answer):], answer)
    text = tok.decode(ids).replace(" ", "")
    assert text.count("12345") == 3  # twice in the needle, once as the answer
    deep = tok.decode(passkey_example(tok, 300, 0.9, "12345")["input_ids"]).replace(" ", "")
    assert deep.index("12345") > text.index("12345")
    b = passkey_batch(tok, 4, 200, digits=3, seed=1)
    assert b["input_ids"].shape == (4, 200) and all(len(a) == 3 for a in b["answers"])
    with pytest.raises(RetrofitError, match="too short"):
        passkey_example(tok, 20, 0.5, "12345")


def test_local_text_is_packed_with_eos_and_a_deterministic_validation_split(tmp_path):
    tok = char_tokenizer()
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i}. " * 20)
    section = lm_section(tmp_path, files=[str(tmp_path / "doc*.txt")], seq_len=32, val_blocks=2, shuffle=False)
    data = build_data(section, tok, seed=0, eval_lengths=[64])
    assert data.val.shape == (2, 64)
    stream = torch.cat([data.val.flatten(), data.train.blocks.flatten()])
    assert (stream == tok.eos_token_id).sum() >= 2  # documents separated by EOS
    first = tok("document number 0. ", add_special_tokens=False)["input_ids"]
    assert stream[: len(first)].tolist() == first  # order kept; validation is the first blocks
    again = build_data(section, tok, seed=0, eval_lengths=[64])
    assert torch.equal(again.val, data.val) and torch.equal(again.train.blocks, data.train.blocks)
    batch = data.batch(0, rows=4, length=16)  # staged length: 2 blocks of 32 cut into 4 rows of 16
    assert batch["input_ids"].shape == (4, 16) and torch.equal(batch["input_ids"], batch["labels"])
    assert [b["input_ids"].shape for b in data.eval_batches(48, 1, 2)] == [(2, 48)]


def test_jsonl_and_parquet_files_and_a_column_check(tmp_path):
    tok = char_tokenizer()
    rows = [{"text": f"row {i} says hello. " * 5, "other": i} for i in range(20)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    tokens = {}
    for name in ("a.jsonl", "a.parquet"):
        data = build_data(lm_section(tmp_path, files=[str(tmp_path / name)], seq_len=16, val_blocks=1), tok)
        tokens[name] = data.train.blocks
    assert torch.equal(tokens["a.jsonl"], tokens["a.parquet"])
    with pytest.raises(RetrofitError, match="'body' is not a column; columns: text, other"):
        build_data(lm_section(tmp_path, files=[str(tmp_path / "a.jsonl")], text_field="body"), tok)


def test_resume_position_gives_the_same_next_batches(tmp_path):
    tok = char_tokenizer()
    rows = [{"text": f"line {i} of the corpus. "} for i in range(60)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    for streaming in (False, True):
        section = lm_section(tmp_path, files=[str(tmp_path / "c.jsonl")], seq_len=8, val_blocks=1,
                             streaming=streaming)
        data = build_data(section, tok, seed=1)
        data.batch(0, 3, 8)
        state = json.loads(json.dumps(data.state_dict()))  # what a checkpoint stores
        expected = [data.batch(s, 3, 8)["input_ids"] for s in range(1, 30)]  # crosses an epoch when in memory
        fresh = build_data(section, tok, seed=1)
        fresh.load_state_dict(state)
        if streaming:
            with pytest.raises(RetrofitError, match="ran out"):
                [fresh.batch(s, 3, 8) for s in range(1, 60)]
            fresh = build_data(section, tok, seed=1)
            fresh.load_state_dict(state)
            expected = expected[:10]
        assert all(torch.equal(fresh.batch(s + 1, 3, 8)["input_ids"], e) for s, e in enumerate(expected))


def test_bad_data_fails_in_one_line(tmp_path, monkeypatch):
    tok = char_tokenizer()
    with pytest.raises(RetrofitError, match="no such file"):
        build_data(lm_section(tmp_path, files=[str(tmp_path / "missing.txt")]), tok)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(RetrofitError, match="empty.txt is empty"):  # checked before any tokenizing
        build_data(lm_section(tmp_path, files=[str(tmp_path / "empty.txt")], seq_len=16), tok)
    (tmp_path / "tiny.txt").write_text("ab")
    with pytest.raises(RetrofitError, match="not enough for"):
        build_data(lm_section(tmp_path, files=[str(tmp_path / "tiny.txt")], seq_len=16), tok)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(RetrofitError, match="cannot read .csv"):
        build_data(lm_section(tmp_path, files=[str(tmp_path / "x.csv")]), tok)
    with pytest.raises(RetrofitError, match="needs a tokenizer"):
        build_data(DataSection(task="passkey"))
    import datasets
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RetrofitError, match="cannot reach Hub dataset 'HuggingFaceFW/fineweb-edu'") as err:
        build_data(lm_section(tmp_path, dataset="HuggingFaceFW/fineweb-edu", config="sample-10BT", streaming=True), tok)
    assert "\n" not in str(err.value)


def test_validation_files_give_the_first_val_blocks(tmp_path):
    tok = char_tokenizer()
    (tmp_path / "train.txt").write_text("training text here. " * 30)
    (tmp_path / "val.txt").write_text("held out words. " * 30)
    section = lm_section(tmp_path, files=[str(tmp_path / "train.txt")], val_files=[str(tmp_path / "val.txt")],
                         seq_len=16, val_blocks=3)
    data = build_data(section, tok, eval_lengths=[32])
    assert data.val.shape == (3, 32)
    assert tok.decode(data.val[0]).replace(" ", "").startswith("heldoutwords.")
    assert len(data.train.blocks) == (20 * 30 + 1) // 16  # all of train.txt (+ EOS) trains
