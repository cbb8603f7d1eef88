"""The attention modules a patch targets, and the guard for reading their parameters outside a forward.

    for name, module in attention_modules(model):   # ("model.layers.0.self_attn", LlamaAttention) ...
    check_unsharded(norms, "calibrate")              # refused in one line under ZeRO-3 or FSDP2

A module is found by the family table (families.py: the attention class of each model_type) or, for a family not in
it, by the shape transformers writes self-attention in. Everything that walks a model's attention uses this one list:
patching, observing (observer.py), calibration, costs, distillation, sequence parallelism.
"""

from __future__ import annotations

from torch import nn

from .errors import RetrofitError
from .families import family_of


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The self-attention modules a patch targets, by the family table or, failing that, by shape."""
    family = family_of(model.config)
    if family is not None:
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ == family.attention]
    # Generic: self-attention modules as transformers writes them (a layer index and the config).
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "config")]


def check_unsharded(modules, what: str) -> None:
    """Refuse reading or writing patch parameters outside a forward when they are sharded: under DeepSpeed
    ZeRO-3 a parameter holds an empty local shard (it has `ds_id`), under FSDP2 a DTensor shard."""
    for module in modules:
        for name, param in module.named_parameters():
            if hasattr(param, "ds_id") or type(param).__name__ == "DTensor":
                raise RetrofitError(f"{what} reads the patch's parameters outside a forward, but they are sharded "
                                    f"(DeepSpeed ZeRO-3 or FSDP: {name}); {what} before sharding — retrofit train "
                                    "calibrates before accelerate.prepare — or on the gathered model")
