"""data.packing: documents: whole documents per row, positions restarting, attention confined to each document.

The parity tests run a packed row through the training loss (retrofit.train.losses.loss_sum) and check that each
document's loss and gradients equal that document run alone, for every norm, on a tiny model built here.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch

import retrofit
from retrofit.data import StreamBlocks, StreamDocuments, build_data
from retrofit.data.packing import pack_documents, packed_batch, plan_rows
from retrofit.errors import RetrofitError
from retrofit.recipe import DataSection, recipe_from_dict
from retrofit.train import read_log, train
from retrofit.train.losses import loss_sum
from tests.data.test_data import lm_section
from tests.tiny import VOCAB, char_tokenizer, tiny_model
from tests.train.test_train import lm_recipe, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PAD = 1000  # a pad id no document holds, so padding is told apart from a one-token piece


def documents_of(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (sum(lengths),), generator=g), lengths


def segments(row: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids, positions, labels) of each run of a packed row (3, T) that starts at a position reset."""
    starts = (row[1] == 0).nonzero().flatten().tolist() + [row.shape[1]]
    return [tuple(row[k, a:b] for k in range(3)) for a, b in zip(starts, starts[1:], strict=False)]


# ---- the packing itself ------------------------------------------------------------------------------------------

def test_every_token_lands_once_in_whole_documents_with_positions_and_labels_restarting():
    lengths = [5, 23, 1, 10, 7, 10, 3, 2, 31, 9]  # 23 and 31 are longer than a row: split at 10
    tokens, _ = documents_of(lengths)
    rows = pack_documents(tokens, lengths, seq_len=10, pad=PAD)
    assert rows.shape[1:] == (3, 10)
    expected, start = collections.Counter(), 0
    for n in lengths:  # the pieces: whole documents, long ones cut at the row length
        for lo in range(0, n, 10):
            expected[tuple(tokens[start + lo: start + min(n, lo + 10)].tolist())] += 1
        start += n
    found = collections.Counter()
    for row in rows:
        for k, (ids, pos, labels) in enumerate(segments(row)):
            assert torch.equal(pos, torch.arange(len(ids)))  # positions restart at every document
            assert labels[0] == -100  # the token before it is not scored on a document it cannot see
            if (ids == PAD).all():
                assert k == len(segments(row)) - 1 and (labels == -100).all()  # padding: last, never scored
                continue
            assert torch.equal(labels[1:], ids[1:])
            found[tuple(ids.tolist())] += 1
    assert found == expected  # nothing lost, nothing duplicated, no document across a row boundary


def test_best_fit_fills_rows_that_can_be_filled_exactly():
    assert sorted(map(sorted, plan_rows([6, 4, 7, 3, 5, 5], 10))) == [[0, 1], [2, 3], [4, 5]]
    rows = pack_documents(*documents_of([6, 4, 7, 3, 5, 5]), seq_len=10, pad=PAD)
    assert len(rows) == 3 and not (rows[:, 0] == PAD).any()


def test_a_staged_length_splits_rows_and_restarts_the_leading_piece():
    lengths = [7, 9, 4, 12]
    tokens, _ = documents_of(lengths)
    blocks = pack_documents(tokens, lengths, seq_len=12, pad=PAD)
    batch = packed_batch(blocks, rows=len(blocks) * 3, length=4)
    assert torch.equal(batch["input_ids"], blocks[:, 0].reshape(-1, 4))
    assert torch.equal(batch["labels"], blocks[:, 2].reshape(-1, 4))
    assert (batch["position_ids"][:, 0] == 0).all()  # every row starts a (piece of a) document
    diffs = batch["position_ids"].diff(dim=1)
    assert ((diffs == 1) | (batch["position_ids"][:, 1:] == 0)).all()


# ---- per-document parity: losses and gradients, every norm --------------------------------------------------------

NORMS = [("softmax", {}), ("avnorm", {"kind": "rms"}), ("psoftmax", {"p": 2.0}), ("ssmax", {}),
         ("softmax1", {}), ("softmax", {"nope": True})]


def _per_document(model, batch, spans):
    """[(loss, {name: grad})] of each document's terms in the packed rows, through the training loss.
    spans: (row, start, end) of each document."""
    out = []
    for row, lo, hi in spans:
        labels = torch.full_like(batch["labels"], -100)
        labels[row, lo:hi] = batch["labels"][row, lo:hi]
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, {**batch, "labels": labels}, "lm")
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


def _alone(model, ids):
    model.zero_grad(set_to_none=True)
    loss = loss_sum(model, {"input_ids": ids[None], "labels": ids[None]}, "lm")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("model_type", "attn"), [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
@pytest.mark.parametrize(("norm", "options"), NORMS, ids=lambda x: x if isinstance(x, str) else str(x))
def test_a_packed_rows_documents_train_exactly_as_each_alone(model_type, attn, norm, options):
    model = tiny_model(model_type, attn_implementation=attn).float()
    retrofit.patch(model, norm, **options)
    lengths = [9, 6, 13, 4, 20, 7]  # 59 tokens: two rows, the second with 5 tokens of padding (EOS, id 2)
    tokens, _ = documents_of(lengths, seed=3)
    rows = pack_documents(tokens, lengths, seq_len=32, pad=2)
    batch = packed_batch(rows, rows=2, length=32)  # two rows with different documents: a mask per row
    spans = [(r, lo, lo + len(s[0])) for r in range(2) for lo, s in zip(
        (batch["position_ids"][r] == 0).nonzero().flatten().tolist(), segments(rows[r]), strict=True)
        if not (s[2] == -100).all()]  # the padding is no document
    assert sorted(hi - lo for _, lo, hi in spans) == sorted(lengths)
    for (row, lo, hi), (loss, grads) in zip(spans, _per_document(model, batch, spans), strict=True):
        ref_loss, ref_grads = _alone(model, batch["input_ids"][row, lo:hi])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_concatenated_rows_do_leak_across_documents():
    """The control: without position resets the same row is one sequence, and a document's loss changes."""
    model = tiny_model("llama").float()
    lengths = [9, 6, 13, 4]
    tokens, _ = documents_of(lengths, seed=3)
    batch = packed_batch(pack_documents(tokens, lengths, seq_len=32, pad=PAD), rows=1, length=32)
    spans = [(0, 9, 15)]
    packed = _per_document(model, batch, spans)[0][0]
    concat = _per_document(model, {k: v for k, v in batch.items() if k != "position_ids"}, spans)[0][0]
    alone = _alone(model, batch["input_ids"][0, 9:15])[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (concat - alone).abs() > 1e-3


def test_avnorm_calibrated_on_packed_rows_equals_calibration_on_each_document_alone():
    lengths = [9, 6, 13, 4]
    tokens, _ = documents_of(lengths, seed=4)
    batch = packed_batch(pack_documents(tokens, lengths, seq_len=32, pad=PAD), rows=1, length=32)
    packed, alone = tiny_model("llama", seed=2), tiny_model("llama", seed=2)
    for model in (packed, alone):
        retrofit.patch(model, "avnorm", kind="rms")
    retrofit.calibrate(packed, [{"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}])
    retrofit.calibrate(alone, [doc[None] for doc in tokens.split(lengths)])
    gains = {n: p for n, p in packed.named_parameters() if ".retrofit." in n}
    assert gains
    for name, value in alone.named_parameters():
        if name in gains:
            torch.testing.assert_close(gains[name], value, rtol=1e-5, atol=1e-6)


# ---- the data pipeline and the recipe -------------------------------------------------------------------------------

def corpus_of_documents(folder) -> tuple[dict, list[list[int]]]:
    """60 short JSONL documents (14..28 tokens: none is split at 32) and their ids with EOS."""
    tok = char_tokenizer()
    docs = [f"document {i} " + "ab " * (i % 5 + 1) for i in range(60)]
    (folder / "d.jsonl").write_text("\n".join('{"text": "%s"}' % d for d in docs))
    ids = [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in docs]
    return dict(files=[str(folder / "d.jsonl")], seq_len=32, val_blocks=2, shuffle=False), ids


def training_documents(ids: list[list[int]], held: int) -> collections.Counter:
    """The documents after the first `held` tokens (validation) and the one validation cut into."""
    first = next(i for i in range(len(ids)) if sum(map(len, ids[: i + 1])) >= held) + 1
    return collections.Counter(tuple(d) for d in ids[first:])


def documents_in(blocks: torch.Tensor) -> collections.Counter:
    return collections.Counter(tuple(s[0].tolist()) for row in blocks for s in segments(row)
                               if not (s[2] == -100).all())


def test_build_data_packs_whole_documents_after_the_same_validation(tmp_path):
    tok = char_tokenizer()
    common, ids = corpus_of_documents(tmp_path)
    concat = build_data(lm_section(tmp_path, **common), tok, seed=0, eval_lengths=[48])
    packed = build_data(lm_section(tmp_path, packing="documents", **common), tok, seed=0, eval_lengths=[48])
    assert torch.equal(concat.val, packed.val)  # validation stays concatenated: comparable across packings
    assert concat.eval_batches(48, 1, 2)[0].keys() == packed.eval_batches(48, 1, 2)[0].keys() == {"input_ids",
                                                                                                   "labels"}
    assert documents_in(packed.train.blocks) == training_documents(ids, held=2 * 48)
    batch = packed.batch(0, rows=4, length=16)
    assert batch.keys() == {"input_ids", "position_ids", "labels"} and batch["input_ids"].shape == (4, 16)
    calib = packed.calibration(64, 32)
    assert calib[0].keys() == {"input_ids", "position_ids"}


def test_a_streamed_corpus_packs_the_same_documents_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(StreamBlocks.__init__, "__defaults__", (5,))  # 5 documents a read: many reads ...
    monkeypatch.setattr(StreamDocuments.__init__, "__kwdefaults__", {"reads_ahead": 1})  # ... and packs
    tok = char_tokenizer()
    common, ids = corpus_of_documents(tmp_path)
    section = lm_section(tmp_path, packing="documents", streaming=True, **common)
    data = build_data(section, tok, seed=0, eval_lengths=[48])
    concat = build_data(lm_section(tmp_path, streaming=True, **common), tok, seed=0, eval_lengths=[48])
    assert torch.equal(data.val, concat.val)
    assert isinstance(data.train, StreamDocuments) and data.train.docs_per_read == 5
    first = data.batch(0, rows=2, length=32)
    state = json.loads(json.dumps(data.state_dict()))  # what a checkpoint's meta.json holds
    rest = []
    with pytest.raises(RetrofitError, match="ran out"):
        while True:
            rest.append(data.train.take(1))
    resumed = build_data(section, tok, seed=0, eval_lengths=[48])
    resumed.load_state_dict(state)
    assert torch.equal(resumed.train.take(len(rest)), torch.cat(rest))  # exactly where it stopped
    rows = torch.cat([torch.stack([first[k] for k in ("input_ids", "position_ids", "labels")], 1), *rest])
    assert documents_in(rows) == training_documents(ids, held=2 * 48)  # nothing lost or repeated


def test_packing_is_checked_in_the_recipe(tmp_path):
    with pytest.raises(RetrofitError, match="generated"):
        DataSection(task="counting", packing="documents")
    with pytest.raises(RetrofitError, match="packing"):
        recipe_from_dict({"model": {"config": {"model_type": "llama"}}, "data": {"task": "lm", "files": ["a.txt"],
                                                                               "packing": "document"}})


def test_an_implementation_that_would_attend_across_documents_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    spec = lm_recipe(corpus, tmp_path / "run", steps=1)
    spec["data"]["packing"] = "documents"
    spec["patch"] = {"norm": None}
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"  # only its varlen path (batch 1) reads the resets
    with pytest.raises(RetrofitError, match="flash_attention_2.*attend to each other"):
        train(recipe_from_dict(spec), model=model)
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_a_documents_recipe_trains_end_to_end_and_evaluates_like_concat(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    lines = (corpus / "text.txt").read_text().splitlines()  # one .txt file is one document: 200 of them instead
    (corpus / "docs.jsonl").write_text("\n".join('{"text": "%s"}' % line for line in lines))
    runs = {}
    for packing in ("concat", "documents"):
        spec = lm_recipe(corpus, tmp_path / packing, steps=4)
        spec["data"].update(packing=packing, files=[str(corpus / "docs.jsonl")])
        spec["eval"] = {"at_steps": [0], "every": 2, "batches": 1, "batch_size": 2}
        spec["output"]["save_every"] = 0
        seen = []
        model = tiny_model("llama", seed=5)
        model.register_forward_pre_hook(lambda m, a, kw, seen=seen: seen.append("position_ids" in kw),
                                        with_kwargs=True)
        result = train(recipe_from_dict(spec), model=model)
        runs[packing] = (result, seen)
    (concat, concat_seen), (docs, docs_seen) = runs["concat"], runs["documents"]
    # 4 steps x 2 micro-batches trained with the position ids; the 3 evaluations ran on concatenated blocks
    assert sum(docs_seen) == 8 and len(docs_seen) == 11 and not any(concat_seen)
    assert docs.evals[0] == concat.evals[0]  # same model, same (concatenated) validation: the same eval
    assert docs.losses != concat.losses and all(torch.isfinite(torch.tensor(v)) for v in docs.losses.values())
    log = read_log(docs.run_dir / "log.jsonl")
    assert {4} <= {r["step"] for r in log if "eval/loss@32" in r}
