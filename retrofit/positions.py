"""Removing positional information (NoPE), per model family (see families.py).

Learned absolute positions (GPT-2's `wpe`) are replaced by a module that adds nothing and accepts any
position (so lengths beyond the table work); rotary embeddings are replaced by the identity rotation
(cos = 1, sin = 0). The causal mask still encodes order implicitly. Both replacements keep the
original module aside, so `restore_positions` puts back exactly what was there.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import RetrofitError
from .families import Family, family_of, layers_without_positions


class NoPositionEmbedding(nn.Module):
    """Stands in for a learned position table: returns zeros of the table's width, for any position."""

    def __init__(self, original: nn.Embedding):
        super().__init__()
        self.embedding_dim = original.embedding_dim
        self._original = [original]  # a list hides it from the module tree (and from state_dict)
        self.register_buffer("anchor", torch.empty(0, dtype=original.weight.dtype,
                                                   device=original.weight.device), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.anchor.new_zeros(*position_ids.shape, self.embedding_dim)  # (B, T, C)


class IdentityRotary(nn.Module):
    """Stands in for a rotary embedding: the rotation by angle 0 at every position (cos = 1, sin = 0).

    What a rotary module returns differs by family — (cos, sin) of the full or the half head size, Llama 4's
    complex freqs_cis, Gemma 3's table chosen by a layer_type argument — so the original is asked once per
    call, at one position, for that structure, and ones (and zeros for sin) of the full shape are returned.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        buffers = [b for name, b in original.named_buffers(recurse=False) if name.endswith("inv_freq")]
        if not buffers:
            raise RetrofitError(f"cannot remove positions: {type(original).__name__} has no inv_freq")
        self._original = [original]
        self.register_buffer("anchor", torch.empty(0, device=buffers[0].device), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        probe = self._original[0](x, torch.zeros_like(position_ids[..., :1]), *args, **kwargs)  # position 0
        lead = position_ids.shape  # (B, T)
        if isinstance(probe, torch.Tensor):  # complex freqs_cis (Llama 4): 1 + 0i
            return torch.ones((*lead, probe.shape[-1]), dtype=probe.dtype, device=probe.device)
        cos, sin = probe
        return (torch.ones((*lead, cos.shape[-1]), dtype=cos.dtype, device=cos.device),
                torch.zeros((*lead, sin.shape[-1]), dtype=sin.dtype, device=sin.device))


def _parent(model: nn.Module, path: str):
    parent_path, _, name = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
        getattr(parent, name)
    except AttributeError:
        raise RetrofitError(f"cannot remove positions: {type(model).__name__} has no module {path!r}") from None
    return parent, name


def remove_positions(model: nn.Module, family: Family) -> str:
    """Replace the family's position module on this model instance; returns what was done (for the report)."""
    parent, name = _parent(model, family.positions_path)
    original = getattr(parent, name)
    if family.positions == "learned":
        setattr(parent, name, NoPositionEmbedding(original))
        return f"{family.positions_path}: learned positions removed"
    setattr(parent, name, IdentityRotary(original))
    return f"{family.positions_path}: rotary made identity" + already_without_positions(model.config, "; ")


def already_without_positions(config, prefix: str = "") -> str:
    """'layers 1, 3 already had no positions' for a family that has such layers (PatchReport), else ''."""
    layers = layers_without_positions(config)
    if not layers:
        return ""
    return prefix + f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))} already had no positions"


def restore_positions(model: nn.Module) -> int:
    """Put back every position module `remove_positions` replaced; returns how many."""
    restored = 0
    for path, module in list(model.named_modules()):
        if isinstance(module, (NoPositionEmbedding, IdentityRotary)):
            parent, name = _parent(model, path)
            original = module._original[0].to(module.anchor.device)
            setattr(parent, name, original)
            restored += 1
    return restored


def has_positions_removed(model: nn.Module) -> bool:
    return any(isinstance(m, (NoPositionEmbedding, IdentityRotary)) for m in model.modules())


def learned_position_limit(config, *, nope: bool = False) -> int | None:
    """The length bound set by learned absolute positions (GPT-2: n_positions = 1024), or None: rotary or
    unknown families, and NoPE-patched models, accept any length. The one place this limit is computed."""
    family = family_of(config)
    if nope or family is None or family.max_learned_positions is None:
        return None
    return int(getattr(config, family.max_learned_positions))


def position_limit(model: nn.Module) -> int | None:
    """learned_position_limit of a loaded (maybe patched) model."""
    return learned_position_limit(model.config, nope=has_positions_removed(model))
