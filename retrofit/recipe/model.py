"""The recipe's `model` section: what to load (source) or build (config), checked against transformers' own
config classes (a model type or config key that transformers does not know fails here, before any download).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from ..bounds import check_heads
from ..errors import RetrofitError, closest, quoted
from .schema import require, setting

ZERO_INIT = ("attention_output", "mlp_output")  # model.zero_init: which projections start at zero


@dataclass
class ModelSection:
    source: str | None = setting(None, "Hub id, local folder (plain or retrofit checkpoint, or a finished "
                                       "`retrofit train` run folder: how a finetune starts from a pretrained base run) "
                                       "or .gguf file; "
                                       "null = build from `config` and pretrain from scratch")
    config: dict | None = setting(None, "with source null: `model_type` (any AutoConfig type) plus its sizes, "
                                        "e.g. {model_type: llama, hidden_size: 64, num_hidden_layers: 2}")
    tokenizer: str | None = setting(None, "tokenizer Hub id or folder; null = the source's own (text tasks need one)")
    revision: str | None = setting(None, "Hub revision (branch, tag or commit) of source")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "dtype the weights train in. auto: float32 master weights whatever the source was saved in (a bf16 "
                "model is upcast on load, exactly; the run saves float32); bfloat16/float16: the weights themselves "
                "train in half precision (updates below a weight's precision are lost). Use train.precision for "
                "mixed precision")
    attn_implementation: Literal["sdpa", "eager"] = setting("sdpa", "kernel the patch wraps; sdpa is faster, eager "
                                                                   "for models without an sdpa path")
    zero_init: list[str] = setting(factory=list, doc="with config (from scratch): start these projections at zero, "
                                                     "weight and bias: attention_output (each attention module's "
                                                     "output projection), mlp_output (each MLP's down projection), as "
                                                     "the AVnorm post's model (modded-nanogpt) does; every layer then "
                                                     "starts as the identity on the residual stream")

    def __post_init__(self):
        require(self.source is None or self.config is None,
              "model: set either source (a pretrained model) or config (from scratch), not both")
        require(self.source is not None or self.config is not None,
              "model: set source (Hub id, folder or .gguf) or config (model_type and sizes) to pretrain from scratch")
        if self.config is not None:
            _check_model_config(self.config)
        for part in self.zero_init:
            require(part in ZERO_INIT, f"model.zero_init: unknown part {quoted(part)}{closest(str(part), ZERO_INIT)}; "
                                    f"choose from {', '.join(ZERO_INIT)}")
        require(not self.zero_init or self.source is None,
             "model.zero_init initializes a model built from model.config; a pretrained source keeps its weights: "
             "drop model.zero_init")


def _check_model_config(config: dict) -> None:
    """model_type must be an AutoConfig type and every key a field of that config (a typo is silently kept
    otherwise)."""
    from transformers import CONFIG_MAPPING  # here, not at the top: a recipe's keys are checked before torch loads

    model_type = config.get("model_type")
    require(isinstance(model_type, str), "model.config needs model_type (e.g. gpt2, llama)")
    require(model_type in CONFIG_MAPPING, f"model.config.model_type {model_type!r} is not a transformers model type"
          f"{closest(model_type, CONFIG_MAPPING.keys())}")
    cls = CONFIG_MAPPING[model_type]
    valid = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | set(inspect.signature(cls).parameters)
    for key in config:
        require(key in valid, f"model.config: {model_type} has no config key {quoted(key)}{closest(key, valid)}")
    for key, value in config.items():  # hidden_size: -64 builds a config, then fails deep in torch.empty
        require(key not in SIZE_KEYS or not isinstance(value, int) or isinstance(value, bool) or value >= 1,
             f"model.config.{key} must be >= 1, got {value}")
    try:  # the config class checks types itself (transformers 5: strict dataclasses): hidden_size: abc
        built = cls(**{k: v for k, v in config.items() if k != "model_type"})
    except Exception as err:  # noqa: BLE001 - whatever the config class raises is a bad model.config
        reason = (str(err).strip().splitlines() or [type(err).__name__])[-1].strip()[:160]
        raise RetrofitError(f"model.config is not a valid {model_type} config ({reason}); fix that value") from None
    check_heads(built, "model.config")  # as a folder's config.json is checked: before any module or folder is made


# model.config keys that are sizes or counts: each must be >= 1 (a negative one fails deep inside torch)
SIZE_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_positions",
             "n_inner", "n_ctx"}
