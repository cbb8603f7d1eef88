"""The RULER-style suite (#28 part 2): deterministic generation at an exact length with the needle at its depth,
RULER's scorers, the tiny model end to end through `retrofit eval`, and the same scores through lm-eval on the
exported tasks. A character tokenizer makes a token a character, so token positions are read off the text too."""

from __future__ import annotations

import json
import re

import pytest
import torch

import retrofit
from retrofit.cli import main
from retrofit.data.ruler_tasks import DEPTH_TASKS, FILLER, TASKS, Haystack, make_instance
from retrofit.errors import RetrofitError
from retrofit.evaluate.report import RESULTS_SCHEMA
from retrofit.evaluate.ruler import evaluate_ruler, greedy_answer, ruler_instances
from retrofit.evaluate.ruler_metric import string_match_all, string_match_part
from tests.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LENGTH = 1024  # the shortest length every task fits at one token per character
BOOK = " ".join(f"Sentence number {i} says the tide came in at {i % 12} o'clock." for i in range(400))


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    tiny_model("llama").save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    (root / "book.txt").write_text(BOOK)
    return root


@pytest.mark.parametrize("task", TASKS)
def test_generation_is_deterministic_in_the_seed(task, tok):
    hay = Haystack(tok, [BOOK])
    one = make_instance(task, tok, hay, length=LENGTH, depth=0.5, seed=3)
    assert one == make_instance(task, tok, hay, length=LENGTH, depth=0.5, seed=3)
    other = make_instance(task, tok, hay, length=LENGTH, depth=0.5, seed=4)
    assert other["input"] != one["input"] and other["outputs"] != one["outputs"]
    assert make_instance(task, tok, hay, length=LENGTH, depth=0.5, seed=3, index=1)["input"] != one["input"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("data", [None, [BOOK]])
def test_prompt_is_the_requested_length(task, data, tok):
    for length in (LENGTH, 1500):
        inst = make_instance(task, tok, Haystack(tok, data), length=length, depth=0.25, seed=1)
        ids = tok(inst["input"], add_special_tokens=False)["input_ids"]
        assert inst["tokens"] == len(ids)
        if task in ("cwe", "fwe"):  # they end at a whole list item: at most one item (here < 16 tokens) under
            assert length - 16 < len(ids) <= length
        else:
            assert len(ids) == length


@pytest.mark.parametrize("task", DEPTH_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.75, 1.0])
def test_needle_sits_at_the_requested_depth(task, depth, tok):
    inst = make_instance(task, tok, Haystack(tok, [BOOK]), length=LENGTH, depth=depth, seed=2, needle="uuid")
    ids = tok(inst["input"], add_special_tokens=False)["input_ids"]
    needle_ids = tok(" " + inst["needle"], add_special_tokens=False)["input_ids"]
    start, end = inst["context"]
    found = [i for i in range(start, end) if ids[i:i + len(needle_ids)] == needle_ids]
    assert len(found) == 1, found
    spans = [m.span() for m in re.finditer(r" One of the special magic uuids for \S+ is: [0-9a-f-]+\.",
                                           inst["input"])]  # every needle; one character is one token here
    assert len(spans) == {"niah": 1, "niah_multikey": 4}.get(task, 4)
    others_before = sum(b - a for a, b in spans if a < found[0])
    haystack = (end - start) - sum(b - a for a, b in spans)
    assert abs((found[0] - start - others_before) - depth * haystack) <= 1


def test_haystack_is_the_data_in_order_from_a_seeded_sentence(tok):
    sentences = re.split(r"(?<=\.)\s+", BOOK)
    starts = set()
    for seed in range(4):
        inst = make_instance("vt", tok, Haystack(tok, [BOOK]), length=LENGTH, seed=seed)
        body = re.sub(r" VAR \w+ = (VAR )?\w+\.", "", inst["input"][inst["context"][0]:inst["context"][1]])
        first = next(i for i, s in enumerate(sentences) if body.startswith(s))
        assert body.startswith(" ".join(sentences[first:first + 5]))
        starts.add(first)
    assert len(starts) > 1
    filler = make_instance("vt", tok, Haystack(tok, None), length=LENGTH)
    assert FILLER.split(".")[0] in filler["input"] and "Sentence number" not in filler["input"]


def test_a_haystack_shorter_than_the_length_is_an_error(tok):
    with pytest.raises(RetrofitError, match="too short for the asked length"):
        make_instance("niah", tok, Haystack(tok, [BOOK[:400]]), length=LENGTH, depth=0.5)


@pytest.mark.parametrize("task", TASKS)
def test_scorer_gives_one_on_the_gold_answer_and_less_on_a_near_miss(task, tok):
    inst = make_instance(task, tok, Haystack(tok, None), length=LENGTH, depth=0.5, needle="number")
    refs = inst["outputs"]
    assert string_match_all(" " + ", ".join(refs).upper() + ".", refs) == 1.0  # case-insensitive
    first = refs[0]
    i = next(k for k, c in enumerate(first) if c.isdigit() or c.isalpha())
    changed = first[:i] + ("1" if first[i] == "0" else "0" if first[i].isdigit() else
                           "z" if first[i].lower() != "z" else "y") + first[i + 1:]
    miss = ", ".join([changed] + refs[1:])
    assert string_match_all(miss, refs) == pytest.approx((len(refs) - 1) / len(refs))
    if len(refs) == 1:
        assert string_match_all(miss, refs) == 0.0
    assert string_match_part(miss, refs) == (1.0 if len(refs) > 1 else 0.0)


@pytest.mark.parametrize("norm", retrofit.norms.available_norms())
def test_greedy_answer_with_the_cache_matches_full_forwards_on_patched_models(norm, tok):
    model = tiny_model("llama")
    retrofit.patch(model, norm)
    inst = make_instance("niah", tok, Haystack(tok, None), length=LENGTH, depth=0.5)
    text = inst["input"][-300:]  # the end of the prompt: one character per token
    ours = greedy_answer(model, tok, text, 12, stop="")
    with torch.no_grad():  # no cache: the whole sequence again at every step
        seq = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        for _ in range(12):
            nxt = model(input_ids=seq, use_cache=False).logits[0, -1].argmax()
            if int(nxt) == model.generation_config.eos_token_id:
                break
            seq = torch.cat([seq, nxt.view(1, 1)], 1)
    assert ours == tok.decode(seq[0, 300:].tolist(), skip_special_tokens=True) and len(seq[0]) > 300


def test_rows_carry_the_mean_interval_and_every_sample(tok, monkeypatch):
    prepared = ruler_instances(tok, ["niah", "vt"], [LENGTH], None, {"samples": 3, "depths": [0.0, 1.0]})
    golden = {i["input"]: i["outputs"] for insts in prepared.values() for i in insts}
    calls = iter(range(100))

    def fake(model, tokenizer, text, max_new_tokens, stop):  # right on every other call: partial and 0/1 scores
        return " ".join(golden[text] if next(calls) % 2 else golden[text][1:])  # all, or all but the first
    monkeypatch.setattr("retrofit.evaluate.ruler.greedy_answer", fake)
    monkeypatch.setattr("retrofit.evaluate.ruler.fresh_dynamic_rope", lambda model: 0)
    rows = evaluate_ruler(None, tok, prepared, progress=False)
    assert [(r["task"], r["depth"]) for r in rows] == [("niah", 0.0), ("niah", 1.0), ("vt", None)]
    assert rows[0]["scores"] == [0.0, 1.0, 0.0] and rows[0]["score"] == pytest.approx(1 / 3)
    assert rows[0]["ci95"] == pytest.approx(retrofit.evaluate.intervals.proportion_interval(1, 3))
    assert rows[1]["scores"] == [1.0, 0.0, 1.0]
    assert rows[2]["scores"] == [0.8, 1.0, 0.8]  # vt: 4 of 5 variables named -> 0.8, a t interval
    assert rows[2]["ci95"] == list(retrofit.evaluate.intervals.mean_interval([0.8, 1.0, 0.8]))


def _eval(model_dir, out, *extra):
    code = main(["eval", str(model_dir / "model"), "--tasks", ",".join(TASKS), "--lengths", str(LENGTH),
                 "--samples", "1", "--depths", "0,1", "--out", str(out), "--no-progress", *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


def test_the_tiny_model_runs_every_task_through_retrofit_eval(model_dir, tok, capsys):
    results = _eval(model_dir, model_dir / "out", "--data", str(model_dir / "book.txt"))
    rows = results["models"][0]["ruler"]
    assert [(r["task"], r["depth"]) for r in rows] == [(t, d) for t in TASKS
                                                       for d in ((0.0, 1.0) if t in DEPTH_TASKS else (None,))]
    prepared = ruler_instances(tok, list(TASKS), [LENGTH], [BOOK], {"samples": 1, "depths": [0.0, 1.0]})
    for r in rows:
        inst = [i for i in prepared[(r["task"], LENGTH)] if i["depth"] == r["depth"] or r["depth"] is None]
        assert r["samples"] == 1 == len(r["scores"]) and r["tokens"] == [inst[0]["tokens"]]
        assert r["scores"] == [string_match_all(r["predictions"][0], inst[0]["outputs"])]
        assert 0.0 <= r["score"] <= 1.0 and r["ci95"] is not None
    md = (model_dir / "out" / "results.md").read_text()
    assert md.count("## RULER ") == len(TASKS)
    lo, hi = rows[0]["ci95"]
    assert f"| model | 0 | {rows[0]['score']:.2f} [{lo:.2f}, {hi:.2f}] (n={rows[0]['samples']}) |" in md
    assert results["settings"]["ruler"]["samples"] == 1
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(results, RESULTS_SCHEMA)
    broken = json.loads(json.dumps(results))
    broken["models"][0]["ruler"][0]["score"] = 1.5
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RESULTS_SCHEMA)


def test_list_tasks_says_what_each_task_is(capsys):
    assert main(["eval", "--list-tasks"]) == 0
    out = capsys.readouterr().out
    for task in ("lm", "passkey", "counting", *TASKS):
        assert len([line for line in out.splitlines() if line.startswith(task + " ")]) == 1, task
    assert "completion framing" in out


def test_export_refuses_a_folder_retrofit_did_not_make(model_dir, tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("my notes")
    code = main(["eval", "--export-harness", str(tmp_path), "--tasks", "niah", "--lengths", str(LENGTH),
                 "--tokenizer", str(model_dir / "model")])
    assert code == 2 and "holds files retrofit did not write" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_lm_eval_on_the_exported_tasks_gives_the_same_scores(model_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra retrofit[eval]")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import retrofit.evaluate.harness  # noqa: F401  (registers the model type)
    tasks = list(TASKS)
    ours = _eval(model_dir, tmp_path / "ours", "--depths", "0.5", "--samples", "1")
    export = tmp_path / "harness"
    assert main(["eval", "--export-harness", str(export), "--tasks", ",".join(tasks), "--lengths", str(LENGTH),
                 "--samples", "1", "--depths", "0.5", "--tokenizer", str(model_dir / "model")]) == 0
    names = [f"ruler_{t}_{LENGTH}" for t in tasks]
    exported = TaskManager(include_path=str(export), include_defaults=False)  # the export alone, no built-in task
    out = simple_evaluate(model="retrofit", model_args=f"pretrained={model_dir / 'model'},max_length=2048",
                          tasks=names, task_manager=exported, log_samples=True, device="cpu", batch_size=1)
    for task, name in zip(tasks, names):
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        row = next(r for r in ours["models"][0]["ruler"] if r["task"] == task)
        assert [s["doc"]["outputs"] for s in samples] == [
            i["outputs"] for i in ruler_instances(char_tokenizer(), [task], [LENGTH], None,
                                                  {"samples": 1, "depths": [0.5]})[(task, LENGTH)]]
        assert [s["filtered_resps"][0] for s in samples] == row["predictions"]
        assert [s["score"] for s in samples] == row["scores"]
        assert out["results"][name]["score,none"] == pytest.approx(row["score"])
