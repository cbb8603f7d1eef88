"""Scoring the RULER-style tasks (retrofit/data/ruler_tasks.py): greedy generation with the KV cache, RULER's scorers.

    rows = evaluate_ruler(model, tokenizer, [4096, 8192], tasks=["niah", "vt"], texts=[book], samples=8)

One row per (task, length, depth for the niah tasks): `score` (mean of the per-sample scores), `samples`,
`ci95` (Wilson when every score is 0 or 1, else the t interval of the mean),
`scores` and `predictions` per sample.
Every niah, vt, cwe and fwe sample is scored by string_match_all (RULER's metric for them): the fraction of the
references found in the generated text, case-insensitive. A sample's text is what greedy decoding produces
within the task's max new tokens, cut at the first blank line (data.ruler_tasks.STOP) and at EOS.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..bounds import MOST, check_size
from ..data.ruler_tasks import DEPTH_TASKS, TASKS, Haystack, instances
from ..errors import RetrofitError, iter_utf8
from .intervals import as_list, mean_interval, proportion_interval
from .ruler_metric import string_match_all
from .scoring import fresh_dynamic_rope

HAYSTACK_READ = 512  # characters of --data read per token of the longest length (64 haystacks of ~8 a token)
DEFAULTS = {"samples": 8, "depths": [0.0, 0.25, 0.5, 0.75, 1.0], "needle": "number", "seed": 0}


def ruler_options(options: dict | None) -> dict:
    """The `ruler` options of an EvalSpec with defaults filled in, checked (one-line errors)."""
    unknown = set(options or {}) - set(DEFAULTS)
    if unknown:
        raise RetrofitError(f"unknown ruler options {sorted(unknown)}: use {', '.join(DEFAULTS)}")
    opts = {**DEFAULTS, **(options or {})}
    if not isinstance(opts["samples"], int) or opts["samples"] < 1:
        raise RetrofitError(f"ruler samples {opts['samples']!r}: give a whole number >= 1")
    check_size(opts["samples"], "ruler samples", MOST["samples"])  # the library's bound too, not only the CLI's
    bad = [d for d in opts["depths"] if not 0.0 <= float(d) <= 1.0]
    if bad or not opts["depths"]:
        raise RetrofitError(f"depth {bad[0] if bad else 'list empty'}: give depths between 0 (start) and 1 (end), "
                            "like 0,0.5,1")
    if opts["needle"] not in ("word", "number", "uuid"):
        raise RetrofitError(f"needle kind {opts['needle']!r}: choose word, number or uuid")
    return opts


def read_texts(files, lengths=()) -> list[str] | None:
    """The --data text files as haystack documents (None: the built-in filler); .json token files refused.
    Read as far as the haystacks need: HAYSTACK_READ x the longest length in characters of all files together
    (~8 characters a token: a book is read whole, a 2 GB dump is not), never a file whole past that."""
    if not files:
        return None
    if any(str(f).endswith(".json") for f in files):
        raise RetrofitError("the RULER tasks cut their haystack from text: give text files as --data, not .json "
                            "token ids (or no --data for the built-in filler)")
    room, texts = HAYSTACK_READ * max(lengths, default=1 << 17), []
    for f in files:
        pieces = []
        for piece in iter_utf8(f, "--data"):
            pieces.append(piece[:room])
            room -= len(pieces[-1])
            if room <= 0:
                break
        texts.append("".join(pieces))
    return texts


def ruler_instances(tokenizer, tasks, lengths, texts=None, options=None) -> dict:
    """{(task, length): [instance, ...]} for the RULER tasks among `tasks`: made before any model runs, so a
    haystack shorter than a length fails first."""
    opts = ruler_options(options)
    hay = Haystack(tokenizer, texts)
    return {(t, n): instances(t, tokenizer, hay, length=n, depths=opts["depths"], samples=opts["samples"],
                              seed=opts["seed"], needle=opts["needle"])
            for n in lengths for t in tasks if t in TASKS}


@torch.no_grad()
def greedy_answer(model, tokenizer, text: str, max_new_tokens: int, stop: str) -> str:
    """The greedy continuation of `text` (KV cache), decoded without special tokens and cut at `stop`."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False, return_tensors="pt")["input_ids"]
    ids = ids.to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad, use_cache=True)
    answer = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    return answer.split(stop)[0] if stop else answer


def score_row(task: str, length: int, depth, insts: list[dict], predictions: list[str]) -> dict:
    """The row of one (task, length, depth): mean score, its 95% interval, each sample's score and text."""
    scores = [string_match_all(p, i["outputs"]) for p, i in zip(predictions, insts)]
    binary = all(s in (0.0, 1.0) for s in scores)
    ci = proportion_interval(int(sum(scores)), len(scores)) if binary else mean_interval(scores)
    return {"task": task, "length": length, "depth": depth, "score": sum(scores) / len(scores),
            "samples": len(scores), "ci95": as_list(ci), "metric": "string_match_all", "scores": scores,
            "predictions": predictions, "tokens": [i["tokens"] for i in insts]}


def evaluate_ruler(model, tokenizer, prepared: dict, *, progress: bool = True, answer=None) -> list[dict]:
    """Rows for every (task, length) of `prepared` (ruler_instances' dict), by length then task then depth.
    answer: `answer(model, tokenizer, text, max_new_tokens, stop) -> str`, default greedy_answer (transformers);
    retrofit.serve.vllm_engine.vllm_greedy_answer with a vllm.LLM as the model (`retrofit eval --engine vllm`)."""
    rows = []
    for length in sorted({n for _, n in prepared}):
        if answer is None:
            fresh_dynamic_rope(model)  # dynamic NTK rescales to the longest sequence seen: start each length afresh
        for (task, n), insts in prepared.items():
            if n != length:
                continue
            for depth in sorted(set(insts.depths), key=lambda d: -1 if d is None else d):
                kept, preds = [], []  # one instance's text at a time: each is dropped once answered
                for i in tqdm(insts.group(depth), total=insts.samples, desc=f"{task} {length}", disable=not progress,
                              leave=False):
                    preds.append((answer or greedy_answer)(model, tokenizer, i["input"], i["max_new_tokens"],
                                                           i["stop"]))
                    kept.append({"outputs": i["outputs"], "tokens": i["tokens"]})
                rows.append(score_row(task, length, depth if task in DEPTH_TASKS else None, kept, preds))
    return rows


def ruler_tasks(tasks) -> list[str]:
    """The RULER tasks among `tasks` (None: none), in the order given."""
    return [t for t in tasks or () if t in TASKS]
