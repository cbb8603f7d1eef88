"""Load retrofit checkpoints by path with transformers' own loaders: one opt-in call, no remote code.

    import retrofit
    retrofit.enable()        # or `import retrofit.auto`, which calls it
    model = AutoModelForCausalLM.from_pretrained("runs/avnorm")   # the patched model: retrofit.from_pretrained's
    pipe = pipeline("text-generation", model="runs/avnorm")        # and AutoPeftModelForCausalLM, lm-eval's `hf`
    retrofit.disable()       # transformers' own classes again

transformers' Auto classes choose the model class by the config's class, and `AutoModelForCausalLM.register(
config_class, model_class, exist_ok=True)` is their documented seam for choosing another one. enable() registers, for
every causal-LM config class, an AutoLoader: a config that carries a `retrofit` record goes to retrofit's loader
(load_checkpoint, given the config transformers read, with the caller's config keywords applied, and the caller's
loading arguments), everything else goes, untouched, to the class transformers would have used. Nothing is imported
or run from a model folder (trust_remote_code stays refused).

What it does not reach: a concrete class's own from_pretrained (`LlamaForCausalLM.from_pretrained(path)`, which TRL's
`SFTTrainer(model=path)` calls) is not an Auto class; it keeps refusing the folder by its guard (record.GUARD), in
retrofit's words. Hand TRL the model instead: `SFTTrainer(model=AutoModelForCausalLM.from_pretrained(path))`.
enable() imports every causal-LM config class transformers ships (not their models): about a second, once.
"""

from __future__ import annotations

import copy
import threading

import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..errors import RetrofitError
from ..load.loader import loading_arguments
from ..load.patched_checkpoint import load_checkpoint
from ..load.sources import refuse_remote_code
from ..patching import patch_from_record
from ..record import drop_record, is_standalone_export, read_record

# Keywords the Auto classes add for the class they call (not the caller's): retrofit's loader takes none of them.
AUTO_KEYWORDS = ("_from_auto", "_from_pipeline", "_commit_hash")
# Keywords some callers pass empty (lm-eval: gguf_file=None, subfolder=""): dropped when empty, refused when set.
EMPTY_KEYWORDS = ("gguf_file", "subfolder", "quantization_config")


class AutoLoader:
    """What AutoModelForCausalLM calls for one config class once enabled: from_pretrained and _from_config dispatch
    on the config's `retrofit` record. Subclassed once per config class by enable() (config_class, original)."""

    config_class: type = None
    model_type: str = ""
    previous = None  # what the Auto class had registered for config_class before enable() (None: transformers')

    @classmethod
    def original(cls):
        """The model class transformers (or an earlier registration) would have used for this config class."""
        if cls.previous is not None:
            return cls.previous
        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cls.model_type])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        _refuse_own_code(config, str(pretrained_model_name_or_path), kwargs.get("trust_remote_code"))
        if read_record(config) is None:
            return cls.original().from_pretrained(pretrained_model_name_or_path, *model_args,
                                                  config=cls.for_original(config), **kwargs)
        return load_patched(str(pretrained_model_name_or_path), config, model_args, kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        """AutoModelForCausalLM.from_config: a config with a record gives the patched architecture (fresh weights)."""
        _refuse_own_code(config, "this config", None)
        record = read_record(config)
        if record is None:
            return cls.original()._from_config(cls.for_original(config), **kwargs)
        config = copy.deepcopy(config)
        drop_record(config)
        kwargs["attn_implementation"] = kwargs.get("attn_implementation") or record.get("base_attn_implementation")
        model = cls.original()._from_config(config, **kwargs)
        patch_from_record(model, record)
        return model


    @classmethod
    def for_original(cls, config):
        """The config the original class takes: the Auto classes hand a class made for a composite config's text part
        (Llama4ForCausalLM for a Llama4Config) that text part, with the parent's quantization_config; they compare
        the class's config_class, which is this loader's own, so the swap is made here as they would make it."""
        text = (getattr(config, "sub_configs", None) or {}).get("text_config")
        if text is None or getattr(cls.original(), "config_class", None) is not text:
            return config
        parent, config = config, config.get_text_config()
        if getattr(parent, "quantization_config", None) is not None:
            config.quantization_config = parent.quantization_config
        return config


def _refuse_own_code(config, source: str, trusted) -> None:
    """A config that names its own code for this Auto class (auto_map): transformers would run that code when trusted
    (from_config does not say whether it is), where the loader registered here stands for the built-in class: one
    line instead of silently the built-in class."""
    own = getattr(config, "auto_map", None) or {}
    if is_standalone_export(config) and trusted is not True:
        return  # retrofit push --standalone's: retrofit's loader reads its record and never runs its file
    if AutoModelForCausalLM.__name__ in own and trusted is not False:
        raise RetrofitError(f"{source} ships its own code (an auto_map) and retrofit.enable() is on: retrofit never "
                            "runs a model's code; call retrofit.disable() to load it with transformers alone")


def load_patched(source: str, config, model_args: tuple, kwargs: dict):
    """retrofit's loader for a checkpoint an Auto class was asked for: its arguments, translated."""
    refuse_remote_code(kwargs.pop("trust_remote_code", False))
    adapter = (kwargs.pop("adapter_kwargs", None) or {}).get("_adapter_model_path")
    if adapter is not None:
        raise RetrofitError(f"{adapter} is a PEFT adapter on the retrofit checkpoint {source}: load it with "
                            "peft's AutoPeftModelForCausalLM or retrofit.from_pretrained")
    if model_args:
        raise RetrofitError(f"{source} is a retrofit checkpoint: positional model arguments are not taken; pass "
                            "keywords")
    for name in AUTO_KEYWORDS:
        kwargs.pop(name, None)
    for name in EMPTY_KEYWORDS:
        if not kwargs.get(name, True):
            kwargs.pop(name)
    if kwargs.get("subfolder"):
        raise RetrofitError(f"{source} is a retrofit checkpoint: subfolder= is not read by retrofit's loader; give "
                            "the subfolder's path")
    dtype, torch_dtype = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    named = {name: kwargs.pop(name, None) for name in ("attn_implementation", "device_map", "revision", "token",
                                                        "cache_dir")}
    named["local_files_only"] = bool(kwargs.pop("local_files_only", False))
    loading = loading_arguments(dtype, torch_dtype, kwargs, **named)  # what is left: from_pretrained's other keywords
    return load_checkpoint(source, config=config, **loading)


def _registered() -> dict:
    """The Auto class's own registrations (config class -> model class): transformers keeps them in its lazy
    mapping's `_extra_content`, which `register` writes and which has no public remover; disable() needs one."""
    return AutoModelForCausalLM._model_mapping._extra_content


def _is_loader(value) -> bool:
    return isinstance(value, type) and issubclass(value, AutoLoader)


# enable() and disable() read and write the Auto class's registrations as one step each: two threads enabling at once
# registered a loader over a loader (its `previous`), so disable() left one in place; one thread's loop over the
# registrations met another's writes ("dictionary changed size during iteration"). Issue 61.
_SWITCH = threading.RLock()


def is_enabled() -> bool:
    with _SWITCH:
        return any(_is_loader(value) for value in list(_registered().values()))


def enable() -> None:
    """Let transformers' Auto classes (and pipeline, PEFT's AutoPeftModel, lm-eval's hf model, which use them) load
    retrofit checkpoints by path, exactly as retrofit.from_pretrained does. Idempotent and thread-safe; disable()
    undoes it. A loader's `previous` is what was registered before (never another loader)."""
    with _SWITCH:
        if is_enabled():
            return
        registered = _registered()
        for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            config_class = CONFIG_MAPPING[model_type]
            if _is_loader(registered.get(config_class)):
                continue  # a config class two model types share (GPT2Config): registered once
            loader = type(f"AutoLoader{config_class.__name__}", (AutoLoader,),
                          {"config_class": config_class, "model_type": model_type,
                           "previous": registered.get(config_class), "__module__": __name__})
            AutoModelForCausalLM.register(config_class, loader, exist_ok=True)


def disable() -> None:
    """transformers' Auto classes exactly as they were before enable() (a class registered before it is back; one
    transformers had is transformers' again): a retrofit checkpoint is refused by its guard. Thread-safe."""
    with _SWITCH:
        registered = _registered()
        for config_class, value in list(registered.items()):
            if _is_loader(value):
                if value.previous is not None:
                    registered[config_class] = value.previous
                else:
                    del registered[config_class]
