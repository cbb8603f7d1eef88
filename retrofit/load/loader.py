"""Run folders, and THE loader: what the user typed -> a model (`load`), with `from_pretrained` as its face.

    model = load("runs/counting")            # CountingModel when the run trained a counting head
    model = load("runs/lora", adapter=True)  # a LoRA run rebuilt on its base from recipe.yaml + adapter/
    model = load("./smollm2.gguf")           # anything else: Hub id, folder, retrofit checkpoint, adapter, pkg:
    model = from_pretrained("runs/avnorm", dtype="bfloat16")   # transformers-shaped: a patched model, else refused
    model, tokenizer = load_base(recipe)     # what a recipe's model section says (a source or a config), unpatched

Saving is save.py's (save_model, atomic); what a recipe does to a model (apply_patch, zero_init, its tokenizer)
is from_recipe.py's.

Every loader in retrofit (eval, diagnose, patch, push, train, bench, the harness, the Python API) goes through
`load`, which decides what a source is here and in checkpoint.checkpoint_or_plain, once:

    run folder without result.json   -> refused: resume it (check_finished)
    run folder with adapter/ only    -> the base from recipe.yaml, patched, plus adapter/ (_load_adapter_run)
    adapter_config.json (folder/Hub) -> adapters.load_adapter (base -> patch -> adapter)
    config.json with `retrofit`      -> checkpoint.load_checkpoint (base -> patch -> patch tensors)
    .gguf / plain folder / Hub id    -> models.plain_model (refused by from_pretrained: nothing to rebuild)
    task.json next to the model      -> CountingModel(model) with its head (task_model.py)

Both take transformers' loading arguments and forward them to every transformers call: revision, token,
cache_dir, local_files_only, attn_implementation, device_map, dtype ("auto", the default: as saved), and any
other keyword of `AutoModelForCausalLM.from_pretrained` (low_cpu_mem_usage, max_memory, offload_folder,
use_safetensors, variant, ...) to the model's loading; `torch_dtype` is the deprecated name of dtype.
trust_remote_code is always False: True is refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import RetrofitError
from ..io.readers import read_json
from ..recipe import Recipe, load_recipe
from .adapters import ADAPTER_CONFIG, check_adapter_tensors, is_adapter, load_adapter
from .from_recipe import apply_patch, recipe_tokenizer, zero_projections
from .models import model_from_config, training_dtype
from .patched_checkpoint import checkpoint_or_plain
from .save import ADAPTER_DIR
from .sources import HUB_ARGS, check_model_files, location, refuse_remote_code, source_kind
from .task_model import HEAD_FILE, TASK_FILE, CountingModel, language_model
from .validate import quiet_peft

# from_pretrained keywords retrofit sets itself: the config is the checkpoint's, the loading report is checked here
OWN_KWARGS = ("config", "output_loading_info", "ignore_mismatched_sizes", "state_dict", "from_tf", "from_flax",
              "gguf_file")


def loading_arguments(dtype, torch_dtype, model_kwargs: dict, **named) -> dict:
    """The `loading` dict every loader below takes: the named arguments, dtype (torch_dtype: its deprecated alias,
    as transformers 5 takes it) and the other from_pretrained keywords, kept apart (model_kwargs) so that only the
    model's own loading gets them."""
    if torch_dtype is not None:
        if dtype not in (None, "auto") and dtype != torch_dtype:
            raise RetrofitError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r} disagree; give one (torch_dtype "
                                "is transformers' deprecated name for dtype)")
        dtype = torch_dtype
    own = sorted(k for k in model_kwargs if k in OWN_KWARGS)
    if own:
        raise RetrofitError(f"{', '.join(own)}: retrofit sets {'it' if len(own) == 1 else 'them'} itself when it "
                            "loads a model (the config and the weights come from the source); leave it out")
    return {"dtype": dtype, **named, "model_kwargs": dict(model_kwargs)}


def load(source, *, task_head: bool = True, adapter: bool = False, dtype=None, attn_implementation=None,
         device_map=None, revision=None, token=None, cache_dir=None, local_files_only: bool = False,
         trust_remote_code: bool = False, torch_dtype=None, **model_kwargs) -> nn.Module:
    """The model behind any source (see the module docstring), in eval mode. `task_head=False` returns the
    language model of a counting run; `adapter=True` rebuilds a LoRA run from its base and adapter/.
    attn_implementation: sdpa for a plain model unless named; for a checkpoint the recorded kernel unless named.
    model_kwargs: any other keyword of transformers' from_pretrained (low_cpu_mem_usage, max_memory, ...)."""
    refuse_remote_code(trust_remote_code)
    loading = loading_arguments(dtype, torch_dtype, model_kwargs, attn_implementation=attn_implementation,
                                device_map=device_map, revision=revision, token=token, cache_dir=cache_dir,
                                local_files_only=local_files_only)
    return _load_source(source, loading, task_head=task_head, adapter=adapter, plain=True)


def from_pretrained(pretrained_model_name_or_path: str | os.PathLike, *, revision: str | None = None,
                    token: str | bool | None = None, cache_dir: str | os.PathLike | None = None,
                    local_files_only: bool = False, attn_implementation: str | None = None,
                    device_map: str | dict | None = None, dtype: str | torch.dtype = "auto",
                    trust_remote_code: bool = False, torch_dtype: str | torch.dtype | None = None,
                    **model_kwargs: Any) -> nn.Module:
    """transformers' from_pretrained for retrofit's models: a retrofit checkpoint or adapter (folder or Hub id), or
    a finished run folder, patched as recorded, in eval mode, taking transformers' loading arguments (forwarded).
    dtype: "auto" keeps the dtype it was saved in (transformers 5's default); float32, bfloat16, float16 convert;
    torch_dtype is its deprecated alias. Every other keyword (low_cpu_mem_usage, max_memory, offload_folder,
    use_safetensors, variant, ...) goes to transformers' from_pretrained of the model.
    A model without a patch record (or a .gguf file) is refused: load it with `retrofit.load.load` or transformers."""
    refuse_remote_code(trust_remote_code)
    loading = loading_arguments(dtype, torch_dtype, model_kwargs, attn_implementation=attn_implementation,
                                device_map=device_map, revision=revision, token=token, cache_dir=cache_dir,
                                local_files_only=local_files_only)
    return _load_source(pretrained_model_name_or_path, loading, task_head=False, adapter=False, plain=False)


def _load_source(source, loading: dict, *, task_head: bool, adapter: bool, plain: bool):
    """What `source` is -> its loader (the module docstring's table); plain=False refuses a model without a patch."""
    run = Path(str(source)).expanduser()
    check_finished(run)
    if adapter or (run.is_dir() and not (run / "config.json").is_file() and (run / ADAPTER_DIR).is_dir()):
        lm = _load_adapter_run(run)
    else:
        lm = _model_at(str(source), loading, plain=plain)
    if not task_head or not (run / TASK_FILE).is_file():
        return lm.eval()
    task = read_json(run / TASK_FILE)
    if task.get("task") != "counting":
        raise RetrofitError(f"{run / TASK_FILE} names an unknown task {task.get('task')!r}")
    model = CountingModel(lm, first_token=bool(task.get("first_token")))
    model.load_task_state(load_file(str(run / HEAD_FILE)))
    return model.eval()


def check_finished(run) -> None:
    """A training run folder without result.json is unfinished (its model may be half-written, or absent):
    refuse it with how to resume it, in every verb that loads it (eval, diagnose, push, patch, the API). A folder
    with recipe.yaml and a model but no log.jsonl or checkpoints is a published run (`retrofit push` before it
    staged result.json): `retrofit train` writes log.jsonl when it starts, long before the model."""
    run = Path(os.path.expanduser(str(run)))
    if not run.is_dir() or (run / "result.json").is_file():
        return
    marks = [n for n in ("recipe.yaml", "checkpoints", "log.jsonl") if (run / n).exists()]
    if marks == ["recipe.yaml"] and ((run / "config.json").is_file() or (run / ADAPTER_CONFIG).is_file()):
        return  # published by an older `retrofit push` (no result.json); a run being trained has log.jsonl
    if marks:
        resume = f"retrofit train {run / 'recipe.yaml'} --resume {run}" if (run / "recipe.yaml").is_file() \
            else f"retrofit train RECIPE --resume {run}"
        raise RetrofitError(f"{run} is an unfinished training run (it has {', '.join(marks)} but no result.json); "
                            f"resume it with `{resume}`, or give a finished run")


def _model_at(source: str, loading: dict, *, plain: bool):
    """An adapter (folder or Hub repository) -> load_adapter; anything else -> checkpoint_or_plain."""
    kind = source_kind(source)
    where, _ = location(source, kind)
    if kind == "folder":
        check_model_files(where)
    hub = {k: loading[k] for k in HUB_ARGS}
    if (kind == "folder" and (Path(where) / ADAPTER_CONFIG).is_file()) or (kind == "hub" and is_adapter(source,
                                                                                                          **hub)):
        return load_adapter(where, **loading)
    return checkpoint_or_plain(source, plain=plain, **loading)


# ---- a recipe's model ----------------------------------------------------------------------------------------------

def load_base(recipe: Recipe):
    """(model, tokenizer) as the recipe's model section says, before any patch or head is added. Here, not in
    from_recipe.py: a source may be any source `load` takes, and `load` rebuilds a LoRA run with it."""
    m = recipe.model
    if m.source is None:
        cfg = dict(m.config)
        model = model_from_config(cfg.pop("model_type"), attn_implementation=m.attn_implementation,
                                  seed=recipe.train.seed, **cfg)
        zero_projections(model, m.zero_init)
        model.to(training_dtype(m.dtype))
    else:  # model.dtype auto: float32 master weights, whatever the source was saved in (see training_dtype)
        model = load(m.source, dtype=training_dtype(m.dtype), attn_implementation=m.attn_implementation,
                     revision=m.revision)
    return model, recipe_tokenizer(recipe)


# ---- run folders -----------------------------------------------------------------------------------------------------

def _load_adapter_run(run: Path) -> nn.Module:
    if not (run / ADAPTER_DIR).is_dir() or not (run / "recipe.yaml").is_file():
        raise RetrofitError(f"{run} has no adapter/ and recipe.yaml to rebuild a LoRA run from")
    summary = read_json(run / "result.json") if (run / "result.json").is_file() else {}
    if summary.get("model_from_recipe") is False:
        raise RetrofitError(f"{run}'s base model was passed in code, not built from its recipe, so its adapter "
                            "cannot be rebuilt; load the merged model (train.peft.save: merged or both)")
    recipe = load_recipe(run / "recipe.yaml")
    base, _ = load_base(recipe)
    apply_patch(base, recipe.patch)  # the calibrated / trained patch parameters come back from the adapter
    from peft import PeftModel  # imported here: most runs have no adapter, and PEFT's import costs ~1 s

    with quiet_peft():
        model = PeftModel.from_pretrained(language_model(base), str(run / ADAPTER_DIR))
    check_adapter_tensors(model, run / ADAPTER_DIR)
    return model
