"""`evaluate_models`: every model at every length -> the results dict (schema in docs/results-schema.md).

    results = evaluate_models(["runs/base", "runs/avnorm"], EvalSpec(data=["persuasion.txt"], lengths="256,...,65536"))

Per source and variant: its data prepared (text tokenized once per tokenizer, every length cut before any model
loads), the model loaded, patched and calibrated on the fly when the spec asks, checked (tasks, lengths,
vocabulary), then each task scored (scoring.py, ruler.py); paired differences to the reference model last
(compare.py).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..calibration import calibrate, text_rows
from ..data.read import read_tokens
from ..errors import RetrofitError, check_token_ids
from ..io.readers import expect, read_yaml
from ..load import CountingModel, language_model, load, load_tokenizer
from ..load.from_recipe import same_rope
from ..load.preflight import check_eval_memory
from ..load.task_model import TASK_FILE
from ..memory import PeakMemory
from ..norms import baseline_norm
from ..patch_spec import EVAL, PATCH_KEYS, PatchSpec
from ..patching import extend_rope, patch_record
from ..patching import patch as patch_model
from ..positions import position_limit
from ..recipe import CountingOptions, build
from ..rope import describe_rope
from .compare import check_references, paired_comparisons
from .intervals import METHOD
from .ruler import evaluate_ruler, read_texts, ruler_instances, ruler_tasks
from .scoring import (
    check_lengths,
    config_value,
    evaluate_counting,
    evaluate_lengths,
    evaluate_passkey,
    original_positions,
)
from .spec import EvalSpec
from .vllm_tasks import vllm_entry
from .windows import cut_windows, read_token_file, tokenize_files, tokenizer_fingerprint


def load_any_tokenizer(source):
    """A tokenizer object; a model source (its tokenizer, or None); or a tokenizer folder. A bare
    vocab.json + merges.txt folder (no tokenizer_config.json) is read as byte-level BPE, GPT-2 style."""
    if source is None or hasattr(source, "get_vocab") or not isinstance(source, (str, Path)):
        return source if hasattr(source, "get_vocab") else None  # a loaded model carries no tokenizer
    return load_tokenizer(source)


def model_name(source) -> str:
    if not isinstance(source, (str, Path)):
        return getattr(getattr(source, "config", None), "model_type", type(source).__name__)
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.name or str(source)


def evaluate_models(sources: list, spec: EvalSpec) -> dict:
    """Evaluate every model (any source `retrofit.load.load` takes, or a loaded model) -> results dict.

    `spec` (EvalSpec, checked when it is made) says at which lengths, on what data, which tasks, and which patch
    or variants to apply on the fly; its fields are documented there. Schema of the result:
    docs/results-schema.md. A model that is already patched is evaluated as it is if it carries the asked patch
    (rope alone: that same rope), else refused; with several variants every source runs once per variant.
    """
    job_names = evaluation_names(sources, spec)  # checks the names and the reference before anything loads
    references = check_references(spec.reference, job_names)
    # each source loads and its longest forward fits (loaded models are skipped): before any data or model is read
    check_eval_memory(sources, spec.lengths, spec.batch_tokens, spec.device, spec.dtype)
    prepared = _prepare_data(sources, spec.data, spec.tokens, spec.tokenizer, spec.lengths, spec.tasks)
    jobs = [(source, prep, ep) for source, prep in zip(sources, prepared) for _, ep in spec.patches]
    results = _results_header(spec, prepared)
    for (source, (key, documents, tok), eval_patch), name in zip(jobs, job_names):
        results["models"].append(_evaluate_model(source, name, Prepared(key, documents, tok), eval_patch, spec))
        gc.collect()
    comparisons = paired_comparisons(results, references)
    if comparisons is not None:
        results["comparisons"] = comparisons
    return results


class Prepared(NamedTuple):
    """One source's data, as _prepare_data made it: its tokenizer's fingerprint, the documents (None: none), the
    tokenizer (None: none needed)."""

    key: str
    documents: list | None
    tokenizer: Any


def _results_header(spec: EvalSpec, prepared: list[tuple]) -> dict:
    """The results dict before any model ran: schema, lengths, data and settings; `models` empty."""
    return {"schema": "retrofit.eval/2", "train_len": spec.train_len, "lengths": spec.lengths,
            "data": {"files": [str(p) for p in spec.data],
                     "documents": [len(d) for d in next((d for _, d, _ in prepared if d), [])]},
            "settings": {"tasks": spec.tasks, "engine": spec.engine, "max_tokens": spec.max_tokens,
                         "max_windows": spec.max_windows, "batch_tokens": spec.batch_tokens,
                         "chunk_tokens": spec.chunk_tokens, "device": str(spec.device), "passkey": spec.passkey,
                         "counting": spec.counting, "window": "L + 1 tokens: read L, predict tokens 1..L",
                         "intervals": METHOD, "ruler": spec.ruler},
            "models": []}


def _evaluate_model(source, name: str, prep: Prepared, eval_patch: dict | None, spec: EvalSpec) -> dict:
    """One source under one variant: checked, loaded, patched on the fly, then every task it asks -> its entry
    in results["models"]."""
    tasks, lengths, tok = spec.tasks, spec.lengths, prep.tokenizer
    _check_vocabulary(_saved_vocab_size(source), prep.documents if tasks is None or "lm" in tasks else None,
                      tok if tasks and "passkey" in tasks else None, name)  # before the load prints anything
    ruler = ruler_tasks(tasks) and _ruler_instances(tok, tasks, lengths, spec.data, spec.ruler, name)  # before loading
    if spec.engine == "vllm":  # generation tasks only (EvalSpec checked): vLLM answers, retrofit scores
        return vllm_entry(source, name, prep.key, tok, ruler, spec)
    model = _load(source, spec.dtype, spec.device)
    lm, counting_model = _language_model(model)
    if eval_patch is not None:
        _patch_on_the_fly(lm, eval_patch, name)
        if eval_patch.get("calibrate"):
            _calibrate_on_the_fly(lm, eval_patch["calibrate"], tok, name)
    wanted = _wanted_tasks(tasks, counting_model, prep, spec.data, name)
    check_lengths(lm, lengths, name)
    _check_vocabulary(lm.get_input_embeddings().num_embeddings, prep.documents if "lm" in wanted else None,
                      tok if "passkey" in wanted else None, name)
    entry = {"name": name, "source": str(source) if isinstance(source, (str, Path)) else None,
             "model_type": lm.config.model_type, "tokenizer": prep.key, "dtype": str(lm.dtype).removeprefix("torch."),
             "retrofit": getattr(lm.config, "retrofit", None), "max_learned_positions": position_limit(lm),
             "max_position_embeddings": config_value(lm.config, "max_position_embeddings"),
             "rope": describe_rope(patch_record(lm)), "original_positions": original_positions(lm),
             "eval_patch": eval_patch, "memory_kind": PeakMemory(spec.device).kind, "lengths": []}
    if "lm" in wanted:
        entry["lengths"] = evaluate_lengths(lm, prep.documents, lengths, max_tokens=spec.max_tokens,
                                            max_windows=spec.max_windows,
                                            batch_tokens=spec.batch_tokens, chunk_tokens=spec.chunk_tokens,
                                            name=name, progress=spec.progress)
    if "passkey" in wanted:
        entry["passkey"] = evaluate_passkey(lm, tok, lengths, batch_tokens=spec.batch_tokens, **(spec.passkey or {}))
    if ruler:  # the RULER-style tasks: retrofit/evaluate/ruler.py
        entry["ruler"] = evaluate_ruler(lm, tok, ruler, progress=spec.progress)
    if "counting" in wanted:
        options = {"alphabet": _run_alphabet(source), **(spec.counting or {})}
        entry["counting"] = evaluate_counting(model, lengths, batch_tokens=spec.batch_tokens, **options)
    return entry


def _wanted_tasks(tasks, counting_model: bool, prep: Prepared, data, name: str) -> list[str]:
    """The tasks this model runs (default: counting for a counting run, else lm), checked against what it is and
    what it was given."""
    wanted = tasks or (["counting"] if counting_model else ["lm"])
    if counting_model != ("counting" in wanted) or (counting_model and len(wanted) > 1):
        raise RetrofitError(f"{name} is {'a counting run' if counting_model else 'a language model'}: "
                            f"evaluate it with --tasks {'counting' if counting_model else 'lm and/or passkey'}")
    if "lm" in wanted and prep.documents is None and not data:
        raise RetrofitError("no data to evaluate on: pass --data FILE (text, or .json token ids)")
    if ("lm" in wanted and prep.documents is None) or ("passkey" in wanted and prep.tokenizer is None):
        raise RetrofitError(f"no tokenizer for {name}: pass --tokenizer PATH (a tokenizer folder)")
    return wanted


def evaluation_names(sources: list, spec: EvalSpec) -> list[str]:
    """The name of each evaluation, in order (SOURCE, or SOURCE+VARIANT / VARIANT with variants), checked: one
    name per source, and `spec.reference` one of them. Loads nothing, so the CLI calls it before --out is made."""
    names = list(spec.names) if spec.names else _unique([model_name(s) for s in sources])
    if len(names) != len(sources):
        raise RetrofitError(f"{len(names)} names for {len(sources)} models: give one name per model")
    jobs = [name if variant is None else variant if len(sources) == 1 else f"{name}+{variant}"
            for name in names for variant, _ in spec.patches]
    check_references(spec.reference, jobs)
    return jobs


def _ruler_instances(tok, tasks, lengths, data, options, name) -> dict:
    """The RULER instances for one tokenizer (haystack from the --data text, else the built-in filler)."""
    if tok is None:
        raise RetrofitError(f"no tokenizer for {name}: pass --tokenizer PATH (a tokenizer folder)")
    return ruler_instances(tok, tasks, lengths, read_texts(data, lengths), options)


def _saved_vocab_size(source) -> int | None:
    """vocab_size from a model folder's config.json (the embedding rows it was saved with), or None when there is
    no such plain file to read: the check after loading covers Hub ids, .gguf files, adapters, counting runs."""
    folder = Path(os.path.expanduser(str(source))) if isinstance(source, (str, Path)) else None
    config = folder / "config.json" if folder and not (folder / TASK_FILE).exists() else None  # counting: after
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("vocab_size") if config and config.is_file() \
            else None
    except (ValueError, OSError, AttributeError):  # damaged or odd: the load names it
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_vocabulary(rows: int | None, documents, tok, name: str) -> None:
    """Every token id the evaluation feeds the model (the documents' ids; the passkey tokenizer's vocabulary) has
    an embedding row: a one-line error instead of an IndexError in the first forward. rows None: not known yet."""
    if rows is None:
        return
    if documents:
        check_token_ids(int(max((int(torch.as_tensor(d).max()) for d in documents if len(d)), default=-1)), rows,
                        "the evaluation data", name)
    if tok is not None:
        check_token_ids(max(tok.get_vocab().values()), rows, "the tokenizer", name)


def _calibrate_on_the_fly(lm, spec: dict, tokenizer, name: str) -> dict:
    """AVNorm gains from spec['data'] (its first spec['tokens'] tokens, in 512-token rows), as retrofit patch
    --calibrate does: a fresh AVNorm without them would be evaluated at unit gain, which no one would use."""
    if tokenizer is None:
        raise RetrofitError(f"no tokenizer for {name} to read the calibration text with: pass --tokenizer")
    budget = spec.get("tokens", 8192)
    ids = read_tokens(spec["data"], tokenizer, "calibrate.data", budget)[:budget]  # reads as far as the budget needs
    return calibrate(lm, text_rows(lm, ids))


def _patch_on_the_fly(lm, wanted: dict, name: str) -> None:
    """Patch an unpatched model as `wanted` says; keep a model that already carries it; refuse any other."""
    record = patch_record(lm)
    if record is None:
        patch_model(lm, PatchSpec.from_flat({**wanted["options"], "norm": wanted["norm"] or baseline_norm(),
                                             **{k: wanted.get(k) for k in PATCH_KEYS}}, EVAL))
        return
    if record.get("rope") is None and wanted["rope"] is not None and wanted["norm"] is None:
        extend_rope(lm, wanted["rope"])  # --rope alone on a patched model without one: its norm stays, as trained
        return
    if not same_rope(record.get("rope"), wanted["rope"]):
        raise RetrofitError(f"{name} is already patched with rope {describe_rope(record)}, not "
                            f"{describe_rope(wanted['rope'])}: evaluate it without --rope, or its unpatched base")
    same_norm = record["norm"] == wanted["norm"] and record.get("options") == wanted["options"] \
        and record.get("gate") == wanted.get("gate") \
        and not (wanted.get("layers") or wanted.get("heads"))  # a selection is for unpatched models too
    if wanted["norm"] is not None and not same_norm:
        raise RetrofitError(f"{name} is already patched with {record['norm']} {record.get('options')}; --patch "
                            "applies to unpatched models: evaluate it without --patch")


def _prepare_data(sources, data, tokens, tokenizer, lengths, tasks) -> list[tuple]:
    """(tokenizer fingerprint, documents or None, tokenizer or None) per source. Text is tokenized once
    per distinct tokenizer, and every length is cut now, so bad data fails before any model loads."""
    if tokens is None and data and any(str(p).endswith(".json") for p in data):
        if not all(str(p).endswith(".json") for p in data):
            raise RetrofitError("--data mixes .json token files and text files: give one kind")
        tokens = [doc for path in data for doc in read_token_file(path)]
    if tokens is not None:
        tokens = tokens if tokens and isinstance(tokens[0], (list, tuple)) else [tokens]
    elif not data and tasks and "lm" in tasks:
        raise RetrofitError("no data to evaluate on: pass --data FILE (text, or .json token ids)")
    needs_tokenizer = bool((tokens is None and data) or (tasks and ("passkey" in tasks or ruler_tasks(tasks))))
    explicit = load_any_tokenizer(tokenizer) if needs_tokenizer and tokenizer is not None else None
    prepared, cache = [], {}
    for source in sources:
        tok = (explicit or load_any_tokenizer(source)) if needs_tokenizer else None
        key = tokenizer_fingerprint(tok) if tok is not None else "given"
        documents = tokens
        if tokens is None and data and tok is not None:
            if key not in cache:
                cache[key] = tokenize_files(tok, data)
            documents = cache[key]
        prepared.append((key, documents, tok))
    if tasks is None or "lm" in tasks:
        for documents in {id(d): d for _, d, _ in prepared if d is not None}.values():
            for length in lengths:
                cut_windows(documents, length, 1)
    return prepared


def _load(source, dtype, device):
    if not isinstance(source, (str, Path)):
        return source.eval()
    model = load(str(source), dtype=dtype)  # a run folder (LoRA, counting head) or any source
    if hasattr(model, "peft_config") and hasattr(model, "merge_and_unload"):
        # an adapter folder: PEFT's base_model is its tuner, not the transformer the loss code reads hidden states
        # from; merged, it is the same function as one plain patched model
        model = model.merge_and_unload()
    return model.to(device).eval()


def _language_model(model):
    """(the causal LM inside, whether `model` is a counting model: input_ids -> counts)."""
    return language_model(model), isinstance(model, CountingModel)


def _run_alphabet(source) -> int:
    """The counting alphabet a run trained with (its recipe.yaml), else data/tasks.py's default of 8."""
    recipe = Path(str(source)) / "recipe.yaml"
    if not isinstance(source, (str, Path)) or not recipe.is_file():
        return 8
    data = expect(read_yaml(recipe).get("data") or {}, dict, f"{recipe}: data")
    try:  # typed as a recipe types it: "many" is refused, never int()-ed
        counting = expect(data.get("counting") or {}, dict, "data.counting")
        return build(CountingOptions, counting, "data.counting").alphabet
    except RetrofitError as err:
        raise RetrofitError(f"{recipe}: {err}") from None


def _unique(names: list[str]) -> list[str]:
    return [f"{n}-{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
