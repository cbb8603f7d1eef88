"""What a standalone export's modeling file runs: plain transformers, with no retrofit installed, loads the folder
`retrofit push SRC --standalone` wrote (trust_remote_code=True) and gets the model retrofit.from_pretrained gives.

    class RetrofitLlamaForCausalLM(StandaloneModel, LlamaForCausalLM): ...   # what hub/standalone.py writes

hub/standalone.py vendors this module and everything it imports (patching, the norms, the kernels) into that one
file, under a private package name; the loading below is load/patched_checkpoint.py's, step for step: the base weights
with the recorded attention implementation, checked (patch_tensors.check_base_keys), then the patch from
config.retrofit (patching.patch_from_record), then its tensors, checked (patch_tensors.load_patch_tensors).
retrofit itself never runs this module from a folder: its loader refuses remote code.
"""

from __future__ import annotations

import contextlib
import copy
import json

from .errors import RetrofitError
from .patch_tensors import MARKER, check_base_keys, load_patch_tensors
from .patching import patch_from_record
from .record import drop_guard, drop_record

# from_pretrained's keywords that say where the files are (transformers' cached_file takes them too)
HUB_KEYS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")
INDEX = "model.safetensors.index.json"


class StandaloneModel:
    """Put before a transformers causal-LM class: the patch recorded in config.retrofit, rebuilt on load.

    from_pretrained: the checkpoint's weights and patch, as retrofit.from_pretrained loads them. The constructor
    (from_config, or cls(config)) patches a config that carries a record, so a fresh model has the patch too."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        record = getattr(config, "retrofit", None)
        if record is not None:
            patch_from_record(self, checked_record(record, "config"))

    @classmethod
    def _from_config(cls, config, **kwargs):
        """AutoModelForCausalLM.from_config: the config's guard (record.GUARDS) is no attention implementation;
        the recorded one is (the patch then switches it to retrofit's, as on load)."""
        record = getattr(config, "retrofit", None)
        if record is not None and kwargs.get("attn_implementation") is None:
            config = copy.deepcopy(config)
            drop_guard(config)  # the record stays, for __init__
            kwargs["attn_implementation"] = record.get("base_attn_implementation") or "sdpa"
        return super()._from_config(config, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        return load_standalone(super().from_pretrained, str(pretrained_model_name_or_path), model_args, kwargs)


def checked_record(record, source: str) -> dict:
    if not isinstance(record, dict) or not isinstance(record.get("norm"), str):
        raise RetrofitError(f"{source}'s config.json has no patch record (config.retrofit with a 'norm'): this "
                            "modeling file loads retrofit checkpoints only")
    return record


def load_standalone(load_base, source: str, model_args: tuple, kwargs: dict):
    """load_base: the transformers class's own from_pretrained. Returns the patched model in eval mode (and
    transformers' loading report when output_loading_info=True)."""
    hub = {k: kwargs[k] for k in HUB_KEYS if k in kwargs}
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config or source, **hub)
    config = copy.deepcopy(config)  # the caller's config keeps its record
    record = checked_record(getattr(config, "retrofit", None), source)
    drop_record(config)  # the base loads plain; the patch is rebuilt from `record`
    if kwargs.get("attn_implementation") is None:
        kwargs["attn_implementation"] = record.get("base_attn_implementation") or "sdpa"
    report = kwargs.pop("output_loading_info", False)
    with _quiet():  # the patch tensors are "unexpected" to the base class: checked below instead
        model, info = load_base(source, *model_args, config=config, output_loading_info=True, **kwargs)
    check_base_keys(source, model, record, info)
    patch_from_record(model, record)
    load_patch_tensors(model, saved_patch_tensors(source, hub), source)
    model.eval()
    return (model, info) if report else model


def saved_patch_tensors(source: str, hub: dict) -> dict:
    """Every saved tensor of the norm modules (keys containing '.retrofit.'), from all safetensors shards of a
    folder or a Hub repository (transformers' cached_file finds them where from_pretrained did)."""
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    index = cached_file(source, INDEX, _raise_exceptions_for_missing_entries=False, **hub)
    if index:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    tensors = {}
    for shard in shards:
        tensors.update({k: v for k, v in load_file(cached_file(source, shard, **hub)).items() if MARKER in k})
    return tensors


@contextlib.contextmanager
def _quiet():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


__all__ = ["HUB_KEYS", "StandaloneModel", "checked_record", "load_standalone", "saved_patch_tensors"]
