"""`retrofit push SOURCE --repo OWNER/NAME`: publish a patched checkpoint, a training run or an adapter.

    retrofit push runs/llama-avnorm --repo me/smollm2-avnorm [--private] [--revision main]
    retrofit push runs/lora-run --repo me/smollm2-avnorm-lora           # a LoRA run: its adapter (+ patch)
    retrofit push runs/lora-run --repo me/smollm2-avnorm --merged       # ... or the merged model
    retrofit push runs/llama-avnorm --repo me/smollm2-avnorm --dry-run staged/   # write it, upload nothing

What goes up: safetensors weights, config.json with its `retrofit` section, the tokenizer, README.md (a
model card: metadata, what was patched and why, how to load, a run's recipe and loss curve, the `retrofit
eval` table and plots when found), a run's recipe.yaml and result.json (so the published run reloads as a
finished run), eval/; an adapter with retrofit.json + retrofit.safetensors (retrofit/load/adapters.py). The
pushed config.json sets `"attn_implementation"` to the guard (record.GUARD), so plain transformers refuses it
by name instead of silently running it unpatched (docs/plain-transformers.md); retrofit's loader overrides it.
Every save_pretrained of a patched model writes that guard already (retrofit.record); push sets it again for
folders saved by older retrofits. The only network call is `upload_folder`; the token (`hf auth login` or
HF_TOKEN) is never printed, logged or written. A symbolic link anywhere in the folders push reads is refused
before anything is staged (its target could be any file on this machine), and local paths go up as names:
recipe.yaml, result.json, the card and eval/results.{json,md,csv} (retrofit/hub/public.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, get_token, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import RetrofitError, quoted, read_utf8
from ..evaluate.report import line_plot
from ..io.atomic import atomic_folder, output_path, owned_folder, remove_owned
from ..io.readers import read_json
from ..load.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MARKER,
    RECORD,
    TENSORS,
    adapter_patch_keys,
    load_adapter,
    read_record,
)
from ..load.loader import check_finished
from ..load.patched_checkpoint import patch_tensors
from ..load.sources import check_model_files, is_hub_id
from ..norms import AttentionShape, get_norm, make_options
from ..recipe import load_yaml
from ..train.runlog import read_log
from .model_card import GUARD, model_card
from .origin import ask_for_base, check_adapter_base
from .public import check_no_links, is_local, local_paths, public_json, public_path, public_recipe, rerun_keys
from .standalone import check_standalone, write_standalone

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MODEL_FILES = ("generation_config.json", "model.safetensors.index.json", "task.json", "task_head.safetensors")
# ---- the one network call -------------------------------------------------------------------------------------------

def upload_folder(folder, repo: str, *, private: bool, revision: str | None, token: str) -> str:
    """Create `repo` if needed (and the branch `revision`), upload `folder` as one commit; returns its URL."""
    api = HfApi(token=token)
    api.create_repo(repo, private=private, exist_ok=True)
    if revision and revision != "main":
        api.create_branch(repo, branch=revision, exist_ok=True)
    commit = api.upload_folder(repo_id=repo, folder_path=str(folder), revision=revision,
                               commit_message="Upload retrofit checkpoint")
    return str(getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo}")


# ---- checks before any work -----------------------------------------------------------------------------------------

def check_repo(repo: str) -> None:
    try:
        validate_repo_id(repo)
    except HFValidationError:
        repo = None
    if not repo or "/" not in repo:
        raise RetrofitError("--repo must be a Hub repository id OWNER/NAME, e.g. me/gpt2-avnorm")


def find_token() -> str:
    token = get_token()
    if not token:
        raise RetrofitError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (or use --dry-run DIR)")
    return token


# ---- what SOURCE holds ----------------------------------------------------------------------------------------------

def _json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}  # a mapping, or one line naming the file


def _locate(source) -> tuple[Path | None, Path | None, Path | None]:
    """(model folder with a retrofit config, adapter folder, run folder), each None when absent."""
    path = Path(os.path.expanduser(str(source)))
    if not path.is_dir():
        raise RetrofitError(f"{source}: push takes a local folder (a run, a patched checkpoint or an adapter)")
    check_finished(path)  # an unfinished run: how to resume it, not a half-written model on the Hub
    check_model_files(path)  # config.json that is not JSON, a truncated safetensors file: named
    adapter = next((p for p in (path, path / "adapter") if (p / ADAPTER_CONFIG).is_file()), None)
    config = _json(path / "config.json")
    if config and not isinstance(config.get("retrofit"), dict) and adapter is None:
        raise RetrofitError(f"{source} is not a retrofit checkpoint (its config.json has no 'retrofit' section); "
                            "push plain models with `hf upload`")
    model = path if isinstance(config.get("retrofit"), dict) else None
    runs = (path, path.parent) if adapter == path else (path,)
    run = next((p for p in runs if (p / "recipe.yaml").is_file() or (p / "result.json").is_file()), None)
    if model is None and adapter is None:
        raise RetrofitError(f"{source} holds neither a model (config.json) nor an adapter ({ADAPTER_CONFIG})")
    return model, adapter, run


def _place(src: Path, dst: Path, link: bool) -> None:
    if src.is_symlink():  # check_no_links refused these already; never follow one, whatever the caller
        raise RetrofitError(f"{src} is a symbolic link; push never publishes what a link points to")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)  # staging for an upload: no second copy of the weights
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def _copy_tokenizer(folders, stage: Path, link: bool) -> None:
    for folder in folders:
        found = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
        for f in found:
            _place(f, stage / f.name, link)
        if found:
            return


def _stage_model(model_dir: Path, stage: Path, link: bool) -> dict:
    weights = sorted(model_dir.glob("model*.safetensors"))
    if not weights:
        raise RetrofitError(f"{model_dir} has no safetensors weights; load it with retrofit.from_pretrained and "
                            "save it again with save_pretrained")
    for f in weights + [model_dir / n for n in MODEL_FILES if (model_dir / n).is_file()]:
        _place(f, stage / f.name, link)
    config = _json(model_dir / "config.json")
    config["attn_implementation"] = GUARD
    (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _copy_tokenizer([model_dir], stage, link)
    return {"kind": "model", "record": config["retrofit"], "model_type": config.get("model_type"),
            "task": _json(model_dir / "task.json"),
            "base_model": config.get("_name_or_path"), "patch_files": weights}


def patch_has_parameters(record: dict) -> bool:
    """Whether a recorded patch adds parameters: a norm built with the record's options, on a small shape, has
    any (Norm.has_parameters: ssmax has parameters with scale=learned and none with beyond/llama4, psoftmax only
    with a gain)."""
    norm = record["norm"]
    options = make_options(norm, **(record.get("options") or {}))
    built = get_norm(norm)(options, AttentionShape(num_heads=2, num_kv_heads=2, head_dim=4, max_positions=16))
    return built.has_parameters


def _stage_adapter(adapter_dir: Path, model_dir: Path | None, run: Path | None, stage: Path, link: bool,
                   base_model: str | None) -> dict:
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise RetrofitError(f"{adapter_dir} has no {ADAPTER_WEIGHTS}; save the adapter with safetensors")
    meta = read_record(adapter_dir)
    recorded = meta.get("base_model")
    meta["base_model"] = check_adapter_base(meta, base_model)
    adapter_config = _json(adapter_dir / ADAPTER_CONFIG)
    adapter_config["base_model_name_or_path"] = meta["base_model"]
    (stage / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    (stage / RECORD).write_text(json.dumps(meta, indent=2) + "\n")
    _place(adapter_dir / ADAPTER_WEIGHTS, stage / ADAPTER_WEIGHTS, link)
    if (adapter_dir / TENSORS).is_file():
        _place(adapter_dir / TENSORS, stage / TENSORS, link)
    elif patch_has_parameters(meta["patch"]) and not adapter_patch_keys(adapter_dir):
        # A run's adapter/ without the patch (not trained, so not in modules_to_save): untrained, they equal
        # the run's merged model's; without that model they are lost.
        if model_dir is None:
            raise RetrofitError(f"{adapter_dir} holds neither the patch's parameters nor {TENSORS}, and there is no "
                                "merged model next to it to take them from; re-save it with retrofit.load.save_adapter")
        save_file(patch_tensors(str(model_dir), "folder", None), str(stage / TENSORS))
    _copy_tokenizer([adapter_dir] + ([run] if run else []), stage, link)
    model_type = _json(run / "result.json").get("model_type") if run else None
    return {"kind": "adapter", "record": meta["patch"], "model_type": model_type, "base_model": meta["base_model"],
            "recorded_base": recorded,
            "patch_files": [stage / (TENSORS if (stage / TENSORS).is_file() else ADAPTER_WEIGHTS)]}


def _stage_merged(adapter_dir: Path, run: Path | None, stage: Path, link: bool) -> dict:
    merged = load_adapter(adapter_dir).merge_and_unload()
    scratch = owned_folder(stage / ".merged")  # marked, so the clean-up below can prove it made the folder
    merged.save_pretrained(str(scratch))
    info = _stage_model(scratch, stage, link=False)
    remove_owned(scratch, stage)
    _copy_tokenizer([adapter_dir] + ([run] if run else []), stage, link)
    info["base_model"] = read_record(adapter_dir).get("base_model")
    info["patch_files"] = sorted(stage.glob("model*.safetensors"))
    return info


def _params_added(files) -> int:
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as handle:
            total += sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys() if MARKER in k)
    return total


def _base_license(where) -> str | None:
    """The license in the model card of a folder or of a Hub id in the local cache (no network call)."""
    path = Path(os.path.expanduser(str(where)))
    card = path / "README.md" if path.is_dir() else None
    if card is None and is_hub_id(where):
        cached = try_to_load_from_cache(str(where), "README.md")
        card = Path(cached) if isinstance(cached, str) else None
    if card is None or not card.is_file():
        return None
    try:
        return ModelCard.load(card).data.license or None
    except Exception:  # a README without YAML metadata
        return None


def publishable(source, eval_dir=None) -> tuple:
    """(source folder, model folder, adapter folder, run folder, an experiment's eval folder), each None when
    absent; refused in one line when any folder push reads from holds a symbolic link (check_no_links)."""
    src = output_path(source)
    check_no_links([(src, True)])  # before _locate reads its config.json
    model_dir, adapter_dir, run = _locate(source)
    experiment_eval = run.parent.parent / "eval" if run and run.parent.name == "arms" else None  # retrofit experiment
    roots = [(run, True)] if run and run != src else []  # the run around a named adapter folder
    if eval_dir:
        roots.append((output_path(eval_dir), True))
    elif experiment_eval is not None:
        roots.append((experiment_eval, False))  # found, not named: a link there is refused too
    check_no_links(roots)
    if eval_dir is not None and not (output_path(eval_dir) / "results.md").is_file():
        raise RetrofitError(f"--eval {eval_dir}: no results.md there (write one with `retrofit eval --out DIR`)")
    return src, model_dir, adapter_dir, run, experiment_eval


# ---- the folder to upload -------------------------------------------------------------------------------------------

def stage(source, out, *, repo: str, merged: bool = False, base_model: str | None = None, license: str | None = None,
          eval_dir=None, command: str | None = None, link: bool = False, standalone: bool = False) -> dict:
    """Write into the empty folder `out` exactly what `push` uploads; returns what the model card was made from.
    standalone: add the modeling file plain transformers loads with trust_remote_code=True (hub/standalone.py)."""
    src, model_dir, adapter_dir, run, experiment_eval = publishable(source, eval_dir)
    out = Path(out)
    if merged and model_dir is None:
        info = _stage_merged(adapter_dir, run, out, link)
    elif adapter_dir is not None and not merged:
        info = _stage_adapter(adapter_dir, model_dir, run, out, link, base_model)
    else:
        info = _stage_model(model_dir, out, link)
    info["standalone"] = write_standalone(out, info) if standalone else None
    recipe, run_source = (run / "recipe.yaml" if run else None), None
    if recipe is not None and recipe.is_file():
        text, raw = _read_run_files(run)
        run_source = (raw.get("model") if isinstance(raw.get("model"), dict) else {}).get("source")
        info["recipe_text"] = public_recipe(text)  # local paths go up as file names
        info["rerun_keys"] = rerun_keys(raw)  # ... which a reader gives on the command line to rerun it
        (out / "recipe.yaml").write_text(info["recipe_text"])
    if run is not None and (run / "result.json").is_file():  # a published run is a finished run (check_finished)
        (out / "result.json").write_text(json.dumps(public_json(_json(run / "result.json"), public_path), indent=2)
                                         + "\n")
    bases = [b for b in (base_model, info.pop("recorded_base", None), info["base_model"], run_source) if b]
    info.update(repo=repo, command=command, merged=merged and adapter_dir is not None,
                base_model=next(iter(bases), None),
                params_added=_params_added(info.pop("patch_files")),
                license=license or next(filter(None, map(_base_license, [src, *bases])), None),
                summary=_json(run / "result.json") if run else {},
                curve=_training_curve(run / "log.jsonl", out) if run and (run / "log.jsonl").is_file() else None,
                eval_md=_stage_eval(eval_dir, [p for p in (src, run, run and run / "eval", experiment_eval) if p], out))
    card = model_card(info)
    for local in sorted({b for b in bases if public_path(b) != b} | {str(src)}, key=len, reverse=True):
        card = card.replace(local, public_path(local))  # the card names local folders, never their paths
    (out / "README.md").write_text(card)
    return info


def _read_run_files(run: Path) -> tuple[str, dict]:
    """(text, mapping) of the run's recipe.yaml, after checking it and log.jsonl are what retrofit wrote: a recipe
    that is not a mapping, or a whole log line that is not a step record, is a one-line error naming the file.
    (A log line cut by a kill is not JSON and is skipped, as read_log does.)"""
    path = run / "recipe.yaml"
    text = read_utf8(path)  # a damaged file is a line naming it
    raw = load_yaml(text, str(path)) or {}
    if not isinstance(raw, dict):
        raise RetrofitError(f"{path} is not a recipe (a YAML mapping of sections), it holds {quoted(raw)}; restore "
                            "it, or push the model folder alone")
    log = run / "log.jsonl"
    for number, line in enumerate(read_utf8(log).splitlines() if log.is_file() else [], 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        evals = {k: v for k, v in record.items() if k.startswith("eval/loss@")} if isinstance(record, dict) else {}
        if not isinstance(record, dict) or not isinstance(record.get("step", 0), int) or not all(
                k.split("@", 1)[1].isdigit() and isinstance(v, (int, float)) for k, v in evals.items()):
            raise RetrofitError(f"{log} line {number} is not a training log record ({quoted(line)}); remove that "
                                "line or restore the file")
    return text, raw


def _training_curve(log: Path, out: Path) -> str | None:
    records = read_log(log)
    series = {"train loss": [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]}
    for key in sorted({k for r in records for k in r if k.startswith("eval/loss@")},
                      key=lambda k: int(k.split("@")[1])):
        series[f"eval loss, length {key.split('@')[1]}"] = [(r["step"], r[key]) for r in records if key in r]
    series = {k: tuple(zip(*v)) for k, v in series.items() if v}
    if not series:
        return None
    line_plot(series, out / "training_loss.png", xlabel="step", ylabel="loss", log2x=False)
    return "training_loss.png"


def _stage_eval(eval_dir, candidates, out: Path) -> str | None:
    """Copy results.{md,json,csv} (local paths published as names) and plots into out/eval/; returns the markdown
    for the card (tables, plots)."""
    found = output_path(eval_dir) if eval_dir else next((p for p in candidates if (p / "results.md").is_file()), None)
    if found is None:
        return None
    text = (found / "results.md").read_text()
    results = read_json(found / "results.json") if (found / "results.json").is_file() else {}
    local = local_paths(results) | {p for p in re.findall(r"`([^`\n]+)`", text) if is_local(p)}

    def public(value: str) -> str:
        for path in sorted(local, key=len, reverse=True):  # longest first: a folder's path inside its file's
            value = value.replace(path, public_path(path))
        return value

    eval_out = out / "eval"
    eval_out.mkdir(parents=True, exist_ok=True)
    if results:
        (eval_out / "results.json").write_text(json.dumps(public_json(results, public), indent=1) + "\n")
    for name in ("results.md", "results.csv"):
        if (found / name).is_file():
            (eval_out / name).write_text(public((found / name).read_text()))
    for f in sorted(found.glob("*.png")):
        _place(f, eval_out / f.name, link=False)
    body = public(text[text.find("\n## "):] if "\n## " in text else text)  # tables and plots
    body = re.sub(r"!\[([^\]]*)\]\((?!https?:|/)([^)]+)\)", r"![\1](eval/\2)", body)
    return body.replace("\n## ", "\n### ").strip()


# ---- push -----------------------------------------------------------------------------------------------------------

def push(source, repo: str, *, private: bool = False, revision: str | None = None, merged: bool = False,
         base_model: str | None = None, license: str | None = None, eval_dir=None, dry_run=None,
         command: str | None = None, progress: bool = True, standalone: bool = False) -> str:
    """Stage SOURCE and upload it to `repo` (or, with dry_run=DIR, write the staged folder there atomically).
    Returns the commit URL, or the dry-run folder. progress: say what each step is doing (on stdout: stderr is
    for the one-line error)."""
    # Everything push can refuse without loading is refused here, before any model loads or any folder is made: a
    # `pkg:` base after a 100 s merge-and-stage was found only at the end (issue 62).
    check_repo(repo)
    _, _, adapter_dir, _, _ = publishable(source, eval_dir)  # links and a bad source
    if adapter_dir is not None and not merged:
        check_standalone(standalone)
        check_adapter_base(read_record(adapter_dir), base_model)
    token = None if dry_run else find_token()
    kwargs = dict(repo=repo, merged=merged, base_model=base_model, license=license, eval_dir=eval_dir, command=command,
                  standalone=standalone)
    say = (lambda text: print(f"[push] {text}", flush=True)) if progress else (lambda text: None)
    say(f"staging {source}" + (" (merging the adapter into its base first)" if merged else "")
        + (f" into {dry_run}" if dry_run else ""))
    if dry_run:
        with atomic_folder(dry_run, "--dry-run") as tmp:
            ask_for_base(stage(source, tmp, **kwargs), say)
        return str(output_path(dry_run))
    parent = Path(os.path.expanduser(str(source))).resolve().parent  # same filesystem: weights are hard-linked
    with tempfile.TemporaryDirectory(prefix=".retrofit-push-",
                                     dir=parent if os.access(parent, os.W_OK) else None) as tmp:
        ask_for_base(stage(source, tmp, link=True, **kwargs), say)
        files = [p for p in Path(tmp).rglob("*") if p.is_file()]
        say(f"uploading {len(files)} files ({sum(p.stat().st_size for p in files) / 2**20:,.1f} MiB) to {repo}")
        try:
            return upload_folder(tmp, repo, private=private, revision=revision, token=token)
        except RetrofitError:
            raise
        except Exception as err:  # offline, 401/403, rate limits: one line, never the token
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0].replace(token, "***")[:200]
            raise RetrofitError(f"could not push to {repo} on the Hugging Face Hub ({reason}); check your network "
                                "and token, or write the folder with --dry-run DIR") from None
