"""What a folder (or a model) is, read from its files without loading its weights: `retrofit info PATH`.

    retrofit.info("runs/avnorm")      # {"kind": "run", "norm": "avnorm", "options": {...}, "rope": ..., ...}
    retrofit.info(model)               # the same facts from a model in memory
    print(describe(retrofit.info("runs/avnorm")))

Read: config.json (the architecture and `config.retrofit`, the patch record), the safetensors headers (the patch's
tensor names and shapes: the parameters it added), the patch tensors themselves (small: whether they still hold
the values a fresh patch starts with), a run's result.json (steps, final loss) and an adapter's adapter_config.json.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from pathlib import Path

from torch import nn

from ..errors import RetrofitError, one_line, quoted
from ..io.readers import read_json, read_yaml
from ..norms import get_norm, make_options
from ..norms.base import AttentionShape
from ..record import describe_selection
from ..rope import describe_rope
from .adapters import ADAPTER_CONFIG, read_record
from .models import load_config
from .patched_checkpoint import patch_record_of
from .sources import source_kind

MARKER = ".retrofit."  # the patch's tensors: children named `retrofit` of the attention modules


def info(model_or_path: str | os.PathLike | nn.Module) -> dict:
    """Base, norm, options, layers/heads, rope, dtype, parameters added and whether they moved from their initial
    values, for a folder, Hub id, .gguf file, run folder or adapter (files only), or for a model in memory."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return _path_info(str(model_or_path))
    core = model_or_path.get_base_model() if hasattr(model_or_path, "get_base_model") else model_or_path
    core = getattr(core, "lm", core)  # a counting model: its language model
    tensors = {n: p.detach() for n, p in core.state_dict().items() if MARKER in n and ".modules_to_save." not in n}
    facts = _config_facts(core.config, {n.replace(".original_module.", "."): t.shape for n, t in tensors.items()})
    trainable = sum(p.numel() for n, p in model_or_path.named_parameters() if MARKER in n and p.requires_grad)
    facts = {"kind": "model in memory", "source": getattr(core.config, "_name_or_path", None) or None, **facts,
             "trainable": trainable}
    if facts["norm"]:
        facts["patch_parameters"] = _moved(facts, {n.replace(".original_module.", "."): t for n, t in tensors.items()})
    return facts


def _path_info(source: str) -> dict:
    path = Path(os.path.expanduser(source))
    run = read_json(path / "result.json") if (path / "result.json").is_file() else None
    if path.is_dir() and (path / ADAPTER_CONFIG).is_file():
        return _adapter_info(source, path)
    if run is not None and not (path / "config.json").is_file() and (path / "adapter").is_dir():
        return {**_adapter_info(source, path / "adapter"), "kind": "run (LoRA)", "source": source,
                "training": _training(run)}
    facts = _config_facts(load_config(source), _header_shapes(path) if path.is_dir() else {})
    kind = "run" if run is not None else ("gguf" if source_kind(source) == "gguf" else
                                          "checkpoint" if facts["norm"] else "model")
    head = {"kind": kind, "source": source, "base": _recipe_base(path)}
    if run is not None:
        facts["training"] = _training(run)
    if facts["norm"] and path.is_dir():
        facts["patch_parameters"] = _moved(facts, _patch_tensors(path))
    return {**head, **facts}


def _recipe_base(path: Path) -> str | None:
    """A run's base: its recipe's model.source (or that it was built from a config); None elsewhere."""
    if not (path / "recipe.yaml").is_file():
        return None
    model = read_yaml(path / "recipe.yaml").get("model") or {}
    if not isinstance(model, dict):
        raise RetrofitError(f"{path / 'recipe.yaml'}: model must be a mapping (source or config), got {quoted(model)}")
    return model.get("source") or ("built from model.config" if model.get("config") else None)


def _adapter_info(source: str, folder: Path) -> dict:
    meta = read_record(folder)
    adapter = read_json(folder / ADAPTER_CONFIG)
    facts = {"kind": "adapter", "source": source, "base": meta.get("base_model"), **_record_facts(meta["patch"])}
    facts["adapter"] = {k: adapter.get(k) for k in ("peft_type", "r", "lora_alpha", "target_modules",
                                                     "modules_to_save")}
    facts["patch_trained"] = bool(adapter.get("modules_to_save")) and "retrofit" in adapter["modules_to_save"]
    return facts


def _record_facts(record: dict | None) -> dict:
    if not record:
        return {"norm": None}
    return {"norm": record["norm"], "options": record.get("options") or {}, "nope": bool(record.get("nope")),
            "layers": describe_selection(record.get("layers")), "heads": describe_selection(record.get("heads")),
            "rope": describe_rope(record.get("rope")), "gate": record.get("gate"),
            "attention": record.get("base_attn_implementation"),
            "calibration": record.get("calibration"), "retrofit_version": record.get("retrofit_version")}


def _config_facts(config, shapes: dict) -> dict:
    """The architecture from the config, the patch from its record, the parameters added from tensor shapes."""
    record = patch_record_of(config, "model")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    facts = {"model_type": config.model_type, "dtype": str(getattr(config, "dtype", None) or "unknown").removeprefix(
        "torch."), "num_layers": getattr(text, "num_hidden_layers", None), "num_heads": heads,
             "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
             "head_dim": getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None),
             "max_position_embeddings": getattr(text, "max_position_embeddings", None), **_record_facts(record)}
    facts["parameters_added"] = sum(_numel(s) for n, s in shapes.items() if MARKER in n)
    return facts


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= int(d)
    return total


def _header_shapes(folder: Path) -> dict:
    """Tensor name -> shape from every safetensors file's header (nothing else is read)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(glob.glob(str(folder / "*.safetensors"))):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shapes[name] = f.get_slice(name).get_shape()
    return shapes


def _patch_tensors(folder: Path) -> dict:
    from safetensors import safe_open

    tensors = {}
    for file in sorted(glob.glob(str(folder / "*.safetensors"))):
        with safe_open(file, "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys() if MARKER in n})
    return tensors


def _moved(facts: dict, tensors: dict) -> str:
    """'none' (a patch without parameters), 'initial' (every tensor holds what a fresh patch starts with: not
    calibrated, not trained), or 'calibrated' / 'changed' (trained, or set by hand), naming which tensors."""
    if not tensors:
        return "none"
    options = make_options(facts["norm"], **facts["options"])
    shape = AttentionShape(facts["num_heads"], facts["num_kv_heads"], facts["head_dim"],
                           facts["max_position_embeddings"])
    fresh = get_norm(facts["norm"])(options, shape).state_dict()

    def initial(key: str, tensor) -> bool:
        if key.startswith("gate."):  # retrofit.gate: weight and bias start at zero
            return not bool(tensor.any())
        f = fresh.get(key)
        return f is not None and f.shape == tensor.shape and bool((f.to(tensor.dtype) == tensor).all())

    changed = sorted({key for n, t in tensors.items() if not initial(key := n.split(MARKER, 1)[-1], t)})
    if not changed:
        return "initial (not calibrated, not trained)"
    return ("calibrated" if facts.get("calibration") else "changed") + f" ({', '.join(changed)} moved from the " \
        "initial values" + (": trained or calibrated" if not facts.get("calibration") else "") + ")"


def _training(run: dict) -> dict:
    return {"steps": run.get("steps"), "final_loss": run.get("final_loss"), "processes": run.get("processes")}


def describe(facts: dict) -> str:
    """The facts as `key: value` lines (nested mappings as JSON), for `retrofit info`."""
    lines = []
    for key, value in facts.items():
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        shown = json.dumps(value, default=str) if isinstance(value, (dict, list)) else "-" if value is None else value
        lines.append(f"{key + ':':<24} {one_line(shown)}")  # what a folder's files say: one line each
    return "\n".join(lines)


__all__ = ["describe", "info"]
