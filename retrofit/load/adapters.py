"""PEFT (LoRA) adapters on a patched model: save them with the patch, load them back on their base.

    from retrofit.load.adapters import save_adapter, load_adapter
    save_adapter(peft_model, "runs/x/adapter")        # adapter + retrofit.json + retrofit.safetensors
    model = load_adapter("runs/x/adapter")             # base -> patch -> patch tensors -> PeftModel
    model = retrofit.from_pretrained("runs/x/adapter") # the same (it calls load_adapter for such a folder)
    merged = model.merge_and_unload()                  # a plain patched model: the patch stays
    model = get_peft_model(patched, retrofit.peft_config(patched, LoraConfig(...)))   # the patch trains too

An adapter folder is what PEFT writes (adapter_config.json, adapter_model.safetensors) plus:

    retrofit.json          {"format", "retrofit_version", "base_model", "base_revision", "patch": config.retrofit}
    retrofit.safetensors   the patch's own tensors as the base carries them (`...self_attn.retrofit.gain` ...)

Why the second file: a patch parameter that was not trained (not in `modules_to_save`, e.g. calibrated
AVNorm gains) is in no PEFT file, and rebuilding the patch from its record alone would reset it. When
the patch was trained through `modules_to_save`, the adapter holds the trained copy and this file the
base's original (what `disable_adapter()` runs). Folders written by PEFT alone are read too: inside a
`retrofit train` run (run/adapter) the patch record comes from the run's result.json; elsewhere the base the
adapter names (base_model_name_or_path) must be a retrofit checkpoint, which carries the patch itself.

PEFT has no hook by which a model could add its own modules to `modules_to_save`, so a plain
`get_peft_model(patched, LoraConfig(...))` freezes the patch's parameters (AVNorm gains, SSMax s, sinks):
`peft_config(patched, config)` is the one call that adds the patch's `retrofit` children to them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors
from torch import nn
from transformers.utils import cached_file

from ..errors import RetrofitError, quoted
from ..io.atomic import atomic_folder, atomic_write_text, atomic_writer, refuse_link
from ..io.readers import expect, read_json
from ..patch_tensors import check_finite, listed
from ..patching import patch_from_record, patch_record
from .patched_checkpoint import checkpoint_or_plain
from .sources import hub_error, hub_reachable, source_kind
from .validate import check_record, quiet_peft

if TYPE_CHECKING:  # PEFT is imported where an adapter is loaded: its import costs ~1 s, most runs load none
    from peft import PeftConfig

RECORD, TENSORS = "retrofit.json", "retrofit.safetensors"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FORMAT = 1
MARKER = ".retrofit."  # patch tensors: children named `retrofit` of the attention modules (norms.base.CHILD)
# Files an adapter repository on the Hub needs (tokenizer files ride along when present).
ADAPTER_FILES = [ADAPTER_CONFIG, ADAPTER_WEIGHTS, RECORD, TENSORS, "tokenizer*", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "README.md"]


def base_patch_tensors(model) -> dict:
    """The patch's tensors as the base model holds them, named as in a plain patched checkpoint.

    Through PEFT's modules_to_save wrapper `...retrofit.original_module.gain` is the base's value and
    `...retrofit.modules_to_save.default.gain` the trained copy (saved by PEFT itself): keep the first."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    tensors = {}
    for name, value in core.state_dict().items():
        if MARKER not in name or ".modules_to_save." in name:
            continue
        tensors[name.replace(".original_module.", ".")] = value.detach().contiguous().cpu()
    return tensors


def save_adapter(peft_model, folder, *, base_model: str | None = None, base_revision: str | None = None) -> Path:
    """Write `peft_model`'s adapter and the patch of its base into `folder` (atomically: temp + rename).

    base_model: where load_adapter finds the base (Hub id or folder); default: the adapter config's
    base_model_name_or_path (what the base was loaded from)."""
    if not hasattr(peft_model, "peft_config") or not hasattr(peft_model, "get_base_model"):
        raise RetrofitError(f"save_adapter takes a PEFT model (peft.get_peft_model), got {type(peft_model).__name__}")
    record = patch_record(peft_model.get_base_model())
    if record is None:
        raise RetrofitError("the adapter's base model is not patched: save it with PEFT's save_pretrained")
    config = peft_model.peft_config[peft_model.active_adapter]
    base_model = base_model or config.base_model_name_or_path
    if not base_model:
        raise RetrofitError("the base model was not loaded from a Hub id or folder (it was built from a config), so "
                            "an adapter cannot name it: pass base_model=..., or save the merged model instead")
    out = Path(folder)
    with atomic_folder(out) as tmp:
        saved_name = config.base_model_name_or_path
        config.base_model_name_or_path = str(base_model)  # adapter_config.json names the same base as retrofit.json
        try:
            peft_model.save_pretrained(str(tmp), **peft_save_options(peft_model))
        finally:
            config.base_model_name_or_path = saved_name
        write_patch_files(peft_model, tmp, base_model, base_revision)
    return out


def peft_save_options(peft_model) -> dict:
    """save_pretrained's keywords for a PEFT model retrofit saves: the embeddings only where LoRA adapts them.
    retrofit never resizes the vocabulary, and PEFT's "auto" asks the base's config to find out (a Hub call; for a
    .gguf or pkg: base a "Could not find a config file in pkg:..." warning at every save)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = peft_model.get_base_model()
    targeted = any(isinstance(layer, BaseTunerLayer) for layer in (base.get_input_embeddings(),
                                                                   base.get_output_embeddings()))
    return {"save_embedding_layers": targeted}


def write_patch_files(peft_model, folder, base_model: str, base_revision: str | None = None,
                      tensors: dict | None = None) -> None:
    """retrofit.json and retrofit.safetensors (the module docstring) into `folder`, beside the adapter PEFT wrote
    there (save_adapter, and the axolotl plugin after axolotl saved its adapter). Written by atomic_writer, the one
    way retrofit writes a file: never through a link (one in either name is refused, before either is written).
    tensors: the patch's tensors as the base holds them, when given (a gathered state dict), else read off the model."""
    record = patch_record(peft_model.get_base_model())
    patch_tensors = base_patch_tensors(peft_model) if tensors is None else tensors
    tensors, record_path = refuse_link(Path(folder) / TENSORS), refuse_link(Path(folder) / RECORD)
    meta = {"format": FORMAT, "retrofit_version": record.get("retrofit_version"), "base_model": str(base_model),
            "base_revision": base_revision, "patch": record}
    with atomic_writer(tensors, binary=True) as f:
        f.write(save_tensors(patch_tensors))  # the patch's tensors: kilobytes, held whole
    atomic_write_text(record_path, json.dumps(meta, indent=2) + "\n")


BASE_DIR = "base"  # beside a run's adapter/: the patched base PEFT's AutoPeftModel loads (a .gguf/pkg: base)


def save_loadable_base(peft_model, adapter_dir, base_dir, state_dict=None, named_as=None) -> Path | None:
    """When the adapter's base is a .gguf file or `pkg:` source, which PEFT's AutoPeftModelForCausalLM hands to
    AutoModelForCausalLM as a Hub id (and fails: issue 62), write the patched base without the adapter as a retrofit
    checkpoint in `base_dir`, point adapter_config.json at it (an absolute path: PEFT reads it from any directory)
    and record the source it came from in retrofit.json (what retrofit's own loaders and the model card read).
    After retrofit.enable() PEFT then loads exactly the trained model. None (nothing written) for any other base.

    state_dict: the PEFT model's (gathered) state dict when its parameters are sharded; else its own. named_as: where
    base_dir will be once the caller moves it into place (a run saves into a temporary folder, then renames)."""
    from .sources import resolve_source

    config = peft_model.peft_config[peft_model.active_adapter]
    source = config.base_model_name_or_path
    if not source or not (str(source).startswith("pkg:") or resolve_source(source).endswith(".gguf")):
        return None
    state = peft_model.state_dict() if state_dict is None else state_dict
    base_state = {}
    for name, value in state.items():  # PEFT's names -> the base's: no LoRA tensors, the patch as the base holds it
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")
        base_state[name] = value
    base_dir = Path(base_dir)
    peft_model.get_base_model().save_pretrained(str(base_dir), state_dict=base_state)
    patch_tensors = {k: v.detach().contiguous().cpu() for k, v in base_state.items() if MARKER in k}
    write_patch_files(peft_model, adapter_dir, str(source), getattr(config, "revision", None), patch_tensors)
    adapter_config = Path(adapter_dir) / ADAPTER_CONFIG
    written = read_json(adapter_config)
    written["base_model_name_or_path"] = str(Path(named_as or base_dir).resolve())
    atomic_write_text(adapter_config, json.dumps(written, indent=2, sort_keys=True) + "\n")
    return base_dir


def peft_config(model: nn.Module, config: PeftConfig) -> PeftConfig:
    """`config` (a PEFT config: LoraConfig, ...) with the patch's own modules added to its `modules_to_save`, so
    that `get_peft_model(model, peft_config(model, config))` trains (and PEFT's save_pretrained saves) the norm's
    parameters along with the adapter. A patch without parameters (softmax, psoftmax) leaves it unchanged."""
    from ..patching import CHILD

    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    if patch_record(core) is None:
        raise RetrofitError("peft_config: the model is not patched (retrofit.patch it first): it has no norm "
                            "parameters to train")
    if not hasattr(config, "modules_to_save"):
        raise RetrofitError(f"peft_config: {type(config).__name__} has no modules_to_save; use a LoraConfig (or "
                            "another PEFT config that has it)")
    if has_patch_parameters(core):
        config.modules_to_save = sorted({*(config.modules_to_save or []), CHILD})
    return config


def has_patch_parameters(model: nn.Module) -> bool:
    """Whether the patch's `retrofit` children hold parameters (AVNorm gains, SSMax s, sinks): what PEFT must keep
    training through modules_to_save."""
    from ..patching import CHILD

    return any(True for m in model.modules() if CHILD in m._modules for _ in m._modules[CHILD].parameters())


def _base_record(base: str | None, revision: str | None, hub: dict) -> dict | None:
    """The patch record of the adapter's base (a folder or Hub id) when it is a retrofit checkpoint, else None
    (None too when it cannot be read: the caller's error names it)."""
    from .models import load_config
    from .patched_checkpoint import patch_record_of

    if not base or source_kind(base) == "gguf":
        return None
    try:
        return patch_record_of(load_config(base, revision, **hub), base)
    except (RetrofitError, OSError, ValueError):
        return None


def read_record(folder, **hub) -> dict:
    """retrofit.json of an adapter folder; for a `retrofit train` run's adapter/, built from result.json; for a
    folder PEFT alone wrote on a retrofit checkpoint, the base's own record (the base carries the patch).
    hub: token, cache_dir, local_files_only, for reading the base's config."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file():
        raise RetrofitError(f"{folder} has no {ADAPTER_CONFIG}: it is not a PEFT adapter folder")
    config = read_json(folder / ADAPTER_CONFIG)  # a mapping, checked before anything reads a field of it
    if (folder / RECORD).is_file():
        meta = read_json(folder / RECORD)
        if not isinstance(meta.get("format", FORMAT), int) or meta.get("format", FORMAT) > FORMAT:
            raise RetrofitError(f"{folder} was written by a newer retrofit (format {quoted(meta['format'])}); "
                                "upgrade retrofit")
        expect(meta.get("patch"), dict, f"{folder / RECORD}: patch")
        return meta
    run_summary = folder.parent / "result.json"
    patch = read_json(run_summary).get("retrofit") if run_summary.is_file() else None
    if not isinstance(patch, dict):
        base = config.get("base_model_name_or_path")
        patch = _base_record(base, config.get("revision"), hub)
        if patch is not None:
            return {"format": FORMAT, "retrofit_version": patch.get("retrofit_version"), "base_model": base,
                    "base_revision": config.get("revision"), "patch": patch}
        trained = " (it was trained on a patched model: it holds patch tensors)" if adapter_patch_keys(folder) else ""
        raise RetrofitError(f"{folder} is a PEFT adapter without a retrofit patch record ({RECORD}) and its base "
                            f"{base} is not a retrofit checkpoint{trained}; save the patched base with "
                            "save_pretrained and point base_model_name_or_path at it, save the adapter with "
                            "retrofit.load.save_adapter, or load a plain adapter with peft.PeftModel.from_pretrained")
    return {"format": FORMAT, "retrofit_version": patch.get("retrofit_version"),
            "base_model": config.get("base_model_name_or_path"), "base_revision": config.get("revision"),
            "patch": patch}


def _download(repo: str, revision: str | None, *, token=None, cache_dir=None, local_files_only=False) -> Path:
    """The adapter files of a Hub repository, from the cache when offline."""
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=ADAPTER_FILES, token=token,
                                      cache_dir=cache_dir, local_files_only=local_files_only or not hub_reachable()))
    except Exception as err:  # offline and not cached, no such repo, gated, HTTP errors
        raise hub_error(repo, err) from None


def is_adapter(source, revision: str | None = None, *, token=None, cache_dir=None, local_files_only=False) -> bool:
    """Whether `source` (folder or Hub id) is a PEFT adapter, i.e. holds adapter_config.json."""
    path = Path(os.path.expanduser(str(source)))
    if path.is_dir():
        return (path / ADAPTER_CONFIG).is_file()
    try:
        return cached_file(str(source), ADAPTER_CONFIG, revision=revision, token=token, cache_dir=cache_dir,
                           local_files_only=local_files_only or not hub_reachable(),
                           _raise_exceptions_for_missing_entries=False) is not None
    except Exception:
        return False


def load_adapter(source, *, revision: str | None = None, dtype=None, device_map=None,
                 attn_implementation: str | None = None, is_trainable: bool = False, model_kwargs=None, **hub):
    """A PeftModel: the base from the record, patched as recorded, the patch tensors, then the adapter.

    source: an adapter folder or a Hub repository holding one (revision applies to that repository;
    the base's own revision is recorded in retrofit.json). dtype, device_map, attn_implementation and hub
    (token, cache_dir, local_files_only) and model_kwargs (transformers' other from_pretrained keywords) apply to
    the base as `retrofit.load.load` forwards them."""
    path = Path(os.path.expanduser(str(source)))
    folder = path if path.is_dir() else _download(str(source), revision, **hub)
    meta = read_record(folder, **hub)
    if not meta.get("base_model"):
        raise RetrofitError(f"{source} does not name its base model (base_model_name_or_path is empty); "
                            f"set it in {ADAPTER_CONFIG}")
    _refuse_gguf_folder(meta["base_model"], folder)
    base = checkpoint_or_plain(meta["base_model"], revision=meta.get("base_revision"), dtype=dtype,
                               device_map=device_map, attn_implementation=attn_implementation,
                               model_kwargs=model_kwargs, **hub)
    record, existing = meta["patch"], patch_record(base)
    check_record(record, str(folder / RECORD))  # typed like a checkpoint's config.retrofit: "false" is not a bool
    if existing is None:
        patch_from_record(base, record)
    elif not _same_patch(existing, record):
        raise RetrofitError(f"the base {meta['base_model']} is patched with {existing['norm']}, the adapter was "
                            f"trained on {record['norm']}: point base_model at the unpatched or matching model")
    expected = {k for k in base.state_dict() if MARKER in k}
    saved = load_file(str(folder / TENSORS)) if (folder / TENSORS).is_file() else {}
    in_adapter = adapter_patch_keys(folder)
    missing = {k for k in expected - saved.keys() if k not in in_adapter}
    if missing and existing is None:
        raise RetrofitError(f"{source} lacks {len(missing)} patch tensors (e.g. {sorted(missing)[0]}): neither "
                            f"{TENSORS} nor the adapter holds them; save it with retrofit.load.save_adapter")
    if saved.keys() - expected:
        raise RetrofitError(f"{folder / TENSORS} holds patch tensors the patch does not have "
                            f"({listed(saved.keys() - expected)}): it belongs to another model or patch")
    check_finite(saved, str(folder / TENSORS))
    base.load_state_dict(saved, strict=False)
    from peft import PeftModel  # here, not at the top: PEFT's import costs ~1 s, and most runs train no adapter

    try:
        with quiet_peft():
            model = PeftModel.from_pretrained(base, str(folder), is_trainable=is_trainable)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise RetrofitError(f"could not load the adapter in {source}: "
                            f"{str(err).strip().splitlines()[0][:200]}") from None
    check_adapter_tensors(model, folder)
    return model if is_trainable else model.eval()


def check_adapter_tensors(model, folder: Path) -> None:
    """The adapter file holds exactly the tensors the PEFT model built from its config has (get_peft_model_state_dict:
    what save_pretrained writes). PEFT loads a missing one at its initial value (lora_B: zeros, no adapter there)
    and drops an extra one, without a word: either is refused in one line."""
    from peft import get_peft_model_state_dict

    weights = Path(folder) / ADAPTER_WEIGHTS
    if not weights.is_file():
        return  # another format (adapter_model.bin): PEFT names what it cannot load
    with safe_open(str(weights), "pt") as f:
        saved = set(f.keys())
    expected = set(get_peft_model_state_dict(model).keys())
    problems = [f"{what} {listed(k.removeprefix('base_model.model.') for k in keys)}"
                for what, keys in (("missing", expected - saved), ("unexpected", saved - expected)) if keys]
    if problems:
        raise RetrofitError(f"{weights} is damaged or belongs to another model: LoRA tensors {'; '.join(problems)}; "
                            "save the adapter again (loading it would leave those weights at their initial values)")


def _refuse_gguf_folder(base: str, folder: Path) -> None:
    """An adapter saved on a .gguf base by older retrofits names the GGUF's folder (PEFT took
    transformers' name for the model): say which file to name instead, and where."""
    where = Path(os.path.expanduser(base))
    ggufs = sorted(where.glob("*.gguf")) if where.is_dir() and not (where / "config.json").is_file() else []
    if ggufs:
        key, record = ("base_model", RECORD) if (folder / RECORD).is_file() else \
            ("base_model_name_or_path", ADAPTER_CONFIG)
        raise RetrofitError(f"{folder}'s base {base} is the folder of a GGUF file ({ggufs[0].name}), not a model: set "
                            f"{key} in {folder / record} to that .gguf file (or pkg:NAME/FILE), or save it again "
                            "with retrofit.load.save_adapter(model, folder, base_model=...)")


def _same_patch(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("norm", "options", "nope", "layers", "heads", "gate"))


def adapter_patch_keys(folder: Path) -> set:
    """Patch tensors the adapter itself carries (modules_to_save), named as in the base model."""
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        return set()
    with safe_open(str(weights), "pt") as f:
        names = list(f.keys())
    return {n.removeprefix("base_model.model.") for n in names if MARKER in n}


__all__ = ["BASE_DIR", "adapter_patch_keys", "base_patch_tensors", "is_adapter", "load_adapter", "peft_config",
           "read_record", "has_patch_parameters", "save_adapter", "save_loadable_base", "write_patch_files"]
