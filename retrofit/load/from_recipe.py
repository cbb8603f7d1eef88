"""What a recipe's model and patch sections do to a model: the patch (`apply_patch`), the zeroed projections
(model.zero_init), the tokenizer; `load_base` (loader.py) builds the model with them.

    report = apply_patch(model, recipe.patch)     # None: already carries this patch, or patch.norm null
    zero_projections(model, ["attention_output"]) # a config-built model's output projections start at zero
    tokenizer = recipe_tokenizer(recipe)          # model.tokenizer, else the source's; None for counting
    same_rope(config.retrofit["rope"], "yarn:4")  # whether a recorded RoPE extension is the one asked for

Nothing here loads a model: loader.py imports this module (a LoRA run is rebuilt from its recipe), not the
other way round.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention_modules import attention_modules
from ..errors import RetrofitError
from ..families import mlp_output_projections, output_projection
from ..patching import is_patched, patch, patch_record, unpatch
from ..recipe import PatchSection, Recipe
from ..rope import normalize_rope
from ..selection import parse_selection
from .models import load_tokenizer
from .task_model import language_model


def zero_projections(model: nn.Module, parts) -> int:
    """model.zero_init: the output projections named in `parts` (attention_output, mlp_output) start at zero, weight
    and bias; returns how many were zeroed. A part the model has none of is refused in one line."""
    found = {"attention_output": [output_projection(m) for _, m in attention_modules(model)],
             "mlp_output": mlp_output_projections(model)}
    zeroed = 0
    for part in parts:
        projections = [p for p in found[part] if p is not None]
        if not projections or len(projections) < len(found["attention_output"]):
            raise RetrofitError(f"model.zero_init: {part}: {type(model).__name__} has a layer without an output "
                                f"projection retrofit knows (families.py); drop {part}")
        with torch.no_grad():
            for projection in projections:
                for tensor in (projection.weight, getattr(projection, "bias", None)):
                    if isinstance(tensor, torch.Tensor):
                        tensor.zero_()
        zeroed += len(projections)
    return zeroed


def recipe_tokenizer(recipe: Recipe):
    """model.tokenizer, else the source's own; None for counting (token ids are the symbols)."""
    m = recipe.model
    if m.tokenizer is not None:
        tokenizer = load_tokenizer(m.tokenizer)
        if tokenizer is None:
            raise RetrofitError(f"model.tokenizer {m.tokenizer}: no tokenizer there")
        return tokenizer
    if recipe.data.task == "counting":
        return None
    tokenizer = load_tokenizer(m.source) if m.source is not None else None
    if tokenizer is None:
        raise RetrofitError(f"{m.source} has no tokenizer and data.task {recipe.data.task} needs one: "
                            "set model.tokenizer")
    return tokenizer


def apply_patch(model: nn.Module, section: PatchSection):
    """Patch as the recipe says; a model that already carries this exact patch (norm, options, nope, rope, gate) keeps
    it (and its trained parameters); a different patch replaces it. patch.norm null leaves the model as loaded."""
    spec = section.spec()
    if spec is None:
        return None
    lm = language_model(model)
    record = patch_record(lm)
    if record and record.get("norm") == spec.norm and record.get("nope") == spec.nope \
            and record.get("options") == spec.all_options() and same_rope(record.get("rope"), spec.rope) \
            and _same_selection(lm, record, spec) and record.get("gate") == spec.gate:
        return None
    if is_patched(lm):
        unpatch(lm)
    return patch(lm, spec)


def _same_selection(lm: nn.Module, record: dict, spec) -> bool:
    """Whether the recorded layers/heads (resolved indices, None = all) are what patch.layers/heads select."""
    layers = None if spec.layers is None else \
        parse_selection(spec.layers, len(attention_modules(lm)), "patch.layers")
    heads = None if spec.heads is None else \
        parse_selection(spec.heads, lm.config.num_attention_heads, "patch.heads")
    return record.get("layers") == layers and record.get("heads") == heads


def same_rope(record: dict | None, spec) -> bool:
    """Whether a patch record's rope (config.retrofit["rope"]) is what `spec` (a string, mapping or None) asks for.
    original_max_position_embeddings, filled in by the patch when the spec leaves it out, counts only when given; so
    does the attention factor 1 a temperature-owning norm gave the extension (rope.compose_temperature)."""
    if record is None or spec is None:
        return record is None and spec is None
    wanted, recorded = normalize_rope(spec), dict(record["parameters"])
    for filled in ("original_max_position_embeddings", "attention_factor"):  # filled in by the patch, not given
        if filled not in wanted and (filled != "attention_factor" or record.get("temperature_owner")):
            recorded.pop(filled, None)
    return recorded == wanted
