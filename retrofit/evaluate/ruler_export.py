"""`retrofit eval --list-tasks` and `retrofit eval --export-harness DIR`: the RULER-style instances as
lm-evaluation-harness local tasks, so the harness (model type `retrofit`, retrofit/evaluate/harness.py) runs
exactly what `retrofit eval` runs, offline.

    retrofit eval --export-harness ruler/ --tasks niah,vt --lengths 4096,8192 --data book.txt --tokenizer TOK
    python -m retrofit.evaluate.harness --model retrofit --model_args pretrained=runs/x,max_length=8300 \\
        --include_path ruler/ --tasks ruler_niah_4096,ruler_vt_4096

One YAML and one JSONL (one instance a line: input, outputs, task, length, depth, index, ...) per task x
length, named ruler_TASK_LENGTH; generate_until with the task's stop (a blank line) and max_gen_toks; the
metric `score` is RULER's string_match_all from utils.py, a copy of retrofit/evaluate/ruler_metric.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from ..bounds import MOST, check_bytes, check_size
from ..data.ruler_tasks import DEPTH_TASKS, DESCRIPTIONS, TASKS
from ..errors import RetrofitError
from ..io.atomic import atomic_write_text, atomic_writer, output_folder
from ..lengths import parse_lengths
from ..load import load_tokenizer
from .ruler import read_texts, ruler_instances, ruler_options

# lower bounds, so a refused export surely cannot fit: building a niah instance peaked at 142-153 bytes a token of
# Python memory (tracemalloc, 5K-80K tokens, a character tokenizer; the tokenizer's own memory comes on top), and
# every token is at least one character of the JSONL file
BUILD_BYTES, FILE_BYTES = 128, 1

OTHER_TASKS = {
    "lm": "next-token loss by context length and by position, on --data windows of L + 1 tokens",
    "passkey": "a 5-digit pass key hidden in filler at each depth; greedy accuracy of its tokens",
    "counting": "counting runs only: running count of the target symbol; L1 and MSE",
}
FRAMING = ("RULER tasks use RULER's completion framing for base models (task text, question, then an answer "
           "prefix to continue) and are scored by string_match_all: the fraction of the references in the greedy "
           "output, case-insensitive")


def task_list() -> str:
    """One line per task: its name, what it is and how it is scored."""
    lines = [f"{name:16s} {text}" for name, text in OTHER_TASKS.items()]
    lines += [f"{name:16s} {DESCRIPTIONS[name]}" for name in TASKS]
    return "\n".join(lines + ["", FRAMING])


def task_yaml(name: str, jsonl: Path, max_new_tokens: int, stop: str) -> str:
    """The lm-eval task config of one task x length (its data: the absolute path of the JSONL)."""
    config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(jsonl)}},
              "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{input}}",
              "doc_to_target": "{{outputs[0]}}",
              "generation_kwargs": {"until": [stop], "max_gen_toks": max_new_tokens, "do_sample": False,
                                    "temperature": 0.0},
              "process_results": "PROCESS_RESULTS",
              "metric_list": [{"metric": "score", "aggregation": "mean", "higher_is_better": True}],
              "metadata": {"version": 1.0, "source": "retrofit eval --export-harness"}}
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    return text.replace("PROCESS_RESULTS", "!function utils.process_results")  # lm-eval's tag, not plain YAML


def export_harness(out, tokenizer, tasks, lengths, texts=None, options=None) -> list[str]:
    """Write every (task, length)'s instances into `out` (a folder retrofit made, or a new/empty one); returns
    the task names. Each file is written whole (temporary file, then rename)."""
    prepared = ruler_instances(tokenizer, tasks, lengths, texts, options)
    if not prepared:
        raise RetrofitError(f"--export-harness writes RULER tasks only: give --tasks from {', '.join(TASKS)}")
    names = []
    with output_folder(out, "--export-harness") as folder:
        folder = Path(folder).resolve()
        atomic_write_text(folder / "utils.py", (Path(__file__).parent / "ruler_metric.py").read_text())
        for (task, length), insts in prepared.items():
            name = f"ruler_{task}_{length}"
            with atomic_writer(folder / f"{name}.jsonl") as f:  # one instance in memory at a time
                for i in insts:
                    f.write(json.dumps({k: v for k, v in i.items() if k != "context"}) + "\n")
            first = insts[0]
            atomic_write_text(folder / f"{name}.yaml",
                              task_yaml(name, folder / f"{name}.jsonl", first["max_new_tokens"], first["stop"]))
            names.append(name)
    return names


def check_export_size(out, tasks, lengths, options) -> None:
    """No model sizes an export: each length is at most MOST['length'] tokens, one instance (its text and the
    tokenizer's offsets, ~BUILD_BYTES a token) must fit in memory, and the files (~FILE_BYTES a token) on disk."""
    for n in lengths:
        check_size(n, "--export-harness length", MOST["length"])
    check_bytes(max(lengths) * BUILD_BYTES, f"--export-harness: one instance at length {max(lengths):,}", "--lengths")
    rows = sum(options["samples"] * (len(options["depths"]) if t in DEPTH_TASKS else 1) for t in tasks)
    need = rows * sum(lengths) * FILE_BYTES
    where = Path(out).expanduser().absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise RetrofitError(f"--export-harness would write about {need / 2 ** 30:,.1f} GiB ({rows:,} instances per "
                            f"length) but {where} has {free / 2 ** 30:,.1f} GiB free; lower --samples or --lengths")


def export_tasks(out, tokenizer: str | None, tasks: list[str] | None, lengths, data=None,
                 options: dict | None = None) -> list[str]:
    """`retrofit eval --export-harness OUT`: the RULER tasks `tasks` (None: all) at `lengths` ("4096,8192" or a
    list), their instances measured in the tokenizer at `tokenizer`, written into OUT; returns the task names.
    options: samples, depths, needle, seed (retrofit.evaluate.ruler.ruler_options; None: the defaults)."""
    if not tokenizer:
        raise RetrofitError("--export-harness needs --tokenizer PATH (the tokenizer the instances are measured in)")
    tasks = list(tasks) if tasks else list(TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise RetrofitError(f"--export-harness: {unknown[0]!r} is not a RULER task; choose from {', '.join(TASKS)}")
    loaded = load_tokenizer(tokenizer)
    if loaded is None:
        raise RetrofitError(f"--tokenizer {tokenizer}: no tokenizer there")
    lengths = parse_lengths(lengths) if isinstance(lengths, str) else sorted(set(lengths))
    options = ruler_options(options)  # defaults filled in, checked
    check_export_size(out, tasks, lengths, options)
    return export_harness(out, loaded, tasks, lengths, read_texts(data, lengths), options)
