"""A retrofit checkpoint: a model folder (or Hub repository) whose config.json carries a `retrofit` section.

    model = load_checkpoint("runs/avnorm")   # the base model, then the patch from config.retrofit, then its tensors
    model = checkpoint_or_plain("gpt2")      # a checkpoint as above, anything else as transformers loads it

Both are helpers of `retrofit.load.load` (loader.py), the one loader, and of load/adapters.py (an adapter's base);
code that loads a model calls `load`. Two modules outside load/ import from here for what `load` does not give:
hub/publish.py (`patch_tensors`: the tensors a push must carry) and integrations/auto_classes.py (`load_checkpoint`:
transformers' Auto classes, which have already decided the source is a checkpoint). A test holds
this list to the imports.

Plain transformers would silently drop the norm's tensors and run the original attention, so the
patch is rebuilt here: load the base with the recorded attention implementation, re-apply the patch
(`retrofit.patching.patch_from_record`), then load the patch tensors (keys containing `.retrofit.`).
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.utils import cached_file

from ..errors import RetrofitError
from ..patch_tensors import check_base_keys, listed, load_patch_tensors
from ..patching import CHILD, patch_from_record
from ..record import drop_record, is_standalone_export
from .models import as_dtype, checked_config, load_config, plain_model
from .sources import HUB_ARGS, call_loader, check_safetensors, hub_reachable, location, source_kind
from .validate import check_record, quiet_transformers

__all__ = ["check_base_keys", "checkpoint_or_plain", "is_checkpoint", "listed", "load_checkpoint", "load_patch_tensors",
           "patch_record_of", "patch_tensors", "quiet_transformers"]


def patch_record_of(config, source) -> dict | None:
    """config.retrofit when the config has one (checked against the record's typed schema), else None."""
    if not hasattr(config, "retrofit"):
        return None
    record = config.retrofit
    where = f"{source}/config.json" if source_kind(source) == "folder" else f"{source}'s config.json"
    if not isinstance(record, dict) or not isinstance(record.get("norm"), str):
        raise RetrofitError(f"{where} has a malformed 'retrofit' section (it must be the patch record that "
                            "retrofit.patch writes, with a 'norm'); re-save the model, or remove the section "
                            "to load the base")
    check_record(record, where)
    return record


def is_checkpoint(source, revision: str | None = None, **hub) -> bool:
    """Whether `source` (not a .gguf file) is a retrofit checkpoint."""
    return source_kind(source) != "gguf" and patch_record_of(load_config(source, revision, **hub), source) is not None


def checkpoint_or_plain(source, *, plain: bool = True, **loading):
    """A retrofit checkpoint patched as recorded, else (plain=True) the model as transformers loads it; with
    plain=False anything without a patch record is refused (what `retrofit.from_pretrained` wants). The one place
    that tells a checkpoint from a plain model: `retrofit.load.load` calls it, and so does load_adapter for its
    base. loading: dtype, attn_implementation, device_map and the HUB_ARGS, forwarded."""
    hub = {k: loading[k] for k in HUB_ARGS if k in loading}
    if not plain or is_checkpoint(source, **hub):
        return load_checkpoint(source, **loading)
    return plain_model(source, **loading)


def patch_tensors(source: str, kind: str, revision: str | None, local_files_only: bool = False, *,
                  token=None, cache_dir=None) -> dict[str, torch.Tensor]:
    """Every saved tensor of the norm modules (keys containing '.retrofit.'), from all safetensors shards."""
    if kind == "folder":
        files = sorted(glob.glob(os.path.join(os.path.expanduser(source), "*.safetensors")))
    else:
        local = {"token": token, "cache_dir": cache_dir}
        if local_files_only or not hub_reachable():
            local["local_files_only"] = True
        index = cached_file(source, "model.safetensors.index.json", revision=revision,
                            _raise_exceptions_for_missing_entries=False, **local)
        if index:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            files = [cached_file(source, s, revision=revision, **local) for s in shards]
        else:
            files = [cached_file(source, "model.safetensors", revision=revision, **local)]
    marker = f".{CHILD}."
    tensors = {}
    for f in files:
        check_safetensors(f)  # a damaged file is named, not safetensors' nameless header error
        tensors.update({k: v for k, v in load_file(f).items() if marker in k})
    return tensors


def load_checkpoint(source: str, *, revision: str | None = None, dtype=None, device_map=None,
                    attn_implementation: str | None = None, model_kwargs=None, config=None, **hub):
    """Load a retrofit checkpoint: the base model, then the patch from config.retrofit, then its weights.
    dtype: "auto" (default, also None) keeps the dtype it was saved in; a name or torch dtype converts.
    attn_implementation: the kernel the patch wraps; default the recorded one (base_attn_implementation).
    hub: token, cache_dir, local_files_only, as transformers takes them; model_kwargs: from_pretrained's others.
    config: the source's config as transformers' Auto classes already read it (with the caller's config keywords
    applied); checked like a loaded one, and changed here (its record is moved onto the model)."""
    kind = source_kind(source)
    if kind == "gguf":
        raise RetrofitError(f"{source} is a GGUF file, not a retrofit checkpoint; load it with retrofit.load.load")
    where, _ = location(source, kind)
    config = load_config(source, revision, **hub) if config is None else checked_config(config, source)
    record = patch_record_of(config, source)
    if record is None:
        raise RetrofitError(f"{source} is not a retrofit checkpoint (its config.json has no 'retrofit' section); "
                            "load it with retrofit.load.load or transformers")
    if is_standalone_export(config):  # its modeling file stays with the export: a save of this model is retrofit's
        del config.auto_map
    drop_record(config)  # the base loads plain; the patch is rebuilt from `record`
    # transformers' loading report calls our patch tensors "unexpected" and a NoPE-removed table "missing": it is
    # kept quiet, and checked here instead (check_base_keys): anything else missing or unexpected is an error.
    with quiet_transformers():
        model, info = call_loader(source, kind, AutoModelForCausalLM.from_pretrained, where, config=config,
                                  revision=revision, dtype=as_dtype(dtype), device_map=device_map,
                                  attn_implementation=attn_implementation or record.get("base_attn_implementation",
                                                                                        "sdpa"),
                                  trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True,
                                  **(model_kwargs or {}), **hub)  # a misshapen weight: check_base_keys reports it
    check_base_keys(source, model, record, info)
    patch_from_record(model, record)
    saved = call_loader(source, kind, patch_tensors, source, kind, revision,
                        local_files_only=bool(hub.get("local_files_only")), token=hub.get("token"),
                        cache_dir=hub.get("cache_dir"))
    load_patch_tensors(model, saved, source)
    return model.eval()
