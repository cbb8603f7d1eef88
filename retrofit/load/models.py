"""Plain Hugging Face loading: config, model, tokenizer from a source; a fresh model from a config.

    model = plain_model("gpt2")                          # in its saved dtype (dtype="auto", transformers 5's)
    model = plain_model("./smollm2/SmolLM2.Q4_1.gguf")   # GGUF, dequantized to fp32 by transformers
    tokenizer = load_tokenizer("gpt2")                   # None when the source ships none
    model = model_from_config("llama", hidden_size=64, num_hidden_layers=2)

These know nothing about retrofit's patch; `retrofit.load.load` (load/loader.py) decides what a source is and
calls `plain_model` for a model that carries none. Every function forwards transformers' loading arguments
(revision, token, cache_dir, local_files_only: sources.HUB_ARGS) to transformers unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2TokenizerFast

from ..bounds import check_model_size
from ..errors import RetrofitError
from ..patch_tensors import check_loaded_keys
from .sources import call_loader, location, refuse_custom_code, resolve_source, source_kind
from .validate import check_config, check_raw_config, config_errors, quiet_transformers

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
AUTO = "auto"  # transformers 5's default: the dtype the weights were saved in (config.json's dtype)


def as_dtype(dtype):
    """A torch dtype from a name (float32, bf16, ...), or "auto" (also for None: keep the saved dtype, as
    transformers 5 does); torch dtypes pass through."""
    if dtype is None or dtype == AUTO:
        return AUTO
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise RetrofitError(f"unknown dtype {dtype!r}; use auto (the saved dtype) or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def training_dtype(dtype) -> torch.dtype:
    """The dtype a recipe's model.dtype trains the weights in: auto = float32 master weights whatever the source was
    saved in (bf16 values are exact in fp32; pure-bf16 AdamW loses updates smaller than a weight's precision, so
    half precision is only ever asked for by name; train.precision sets mixed precision)."""
    dtype = as_dtype(dtype)
    return torch.float32 if dtype == AUTO else dtype


def load_config(source: str, revision: str | None = None, **hub):
    """The model config behind `source`; hub: token, cache_dir, local_files_only, as transformers takes them."""
    kind = source_kind(source)
    where, extra = location(source, kind)
    label = f"{source}/config.json" if kind == "folder" else f"{source}'s config"
    if kind == "folder":
        check_raw_config(where, label)
    with config_errors(label):
        config = call_loader(source, kind, AutoConfig.from_pretrained, where, revision=revision,
                             trust_remote_code=False, **extra, **hub)
    return checked_config(config, source, label)


def checked_config(config, source: str, label: str | None = None):
    """A config read from `source` (by load_config or by transformers' Auto classes), checked before any module is
    built from it: sizes, heads, dtype, RoPE factor; a million layers refused here, not built for hours."""
    label = label or f"{source}'s config"
    check_config(config, label)
    check_model_size(config, label)
    return config


def plain_model(source: str, *, dtype=None, attn_implementation: str | None = None, revision: str | None = None,
                device_map=None, model_kwargs=None, **hub):
    """A causal LM from a Hub id, folder or .gguf file, exactly as transformers loads it (the patch-free branch of
    `retrofit.load.load`): in the dtype it was saved in by default (dtype "auto"); a .gguf file dequantized to
    float32 unless a dtype is named; attention sdpa unless named. hub: token, cache_dir, local_files_only.
    A folder or Hub model is checked like a retrofit checkpoint: its config.json's values before anything is built,
    then its weights (none missing, extra or misshapen: load/validate.py)."""
    kind = source_kind(source)
    where, extra = location(source, kind)
    dtype = as_dtype(dtype)
    if kind == "gguf":
        model = call_loader(source, kind, AutoModelForCausalLM.from_pretrained, where, revision=revision,
                            dtype=torch.float32 if dtype == AUTO else dtype,
                            attn_implementation=attn_implementation or "sdpa", device_map=device_map,
                            trust_remote_code=False, **extra, **(model_kwargs or {}), **hub)
        forget_gguf_quantizer(model)
        # transformers names the model after the GGUF's folder (a folder without config.json, which no loader reads);
        # name it as it was given, so that PEFT's base_model_name_or_path and retrofit's adapters load it back
        model.name_or_path = model.config.name_or_path = str(source)
        return model.eval()
    load_config(source, revision, **hub)  # config.json's values, before any module is built
    with quiet_transformers():  # its loading report would come before the one line check_loaded_keys writes
        model, info = call_loader(source, kind, AutoModelForCausalLM.from_pretrained, where, revision=revision,
                                  dtype=dtype, attn_implementation=attn_implementation or "sdpa",
                                  device_map=device_map, trust_remote_code=False, output_loading_info=True,
                                  ignore_mismatched_sizes=True, **extra, **(model_kwargs or {}), **hub)
    check_loaded_keys(source, info)  # checked like a retrofit checkpoint: nothing missing, extra or misshapen
    return model.eval()


def forget_gguf_quantizer(model) -> None:
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


def load_tokenizer(source: str, revision: str | None = None, **hub):
    """The tokenizer that ships with `source` (Hub id, model folder, .gguf), or None when it has none.
    A folder of tokenizer files only also works; a bare vocab.json + merges.txt is read as GPT-2's BPE.
    hub: token, cache_dir, local_files_only, as transformers takes them."""
    path = Path(resolve_source(source)).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():  # tokenizer files only (else: not a model folder)
        refuse_custom_code(path, source)
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        if (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            return GPT2TokenizerFast.from_pretrained(str(path), trust_remote_code=False)
    kind = source_kind(source)
    where, extra = location(source, kind)
    try:
        return call_loader(source, kind, AutoTokenizer.from_pretrained, where, revision=revision,
                           trust_remote_code=False, **extra, **hub)
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
    check_model_size(config, f"a {model_type} config")
    if seed is not None:
        torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, trust_remote_code=False)
