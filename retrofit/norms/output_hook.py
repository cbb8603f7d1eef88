"""How a norm of the heads' outputs (Norm.acts_on_output: AVNorm) runs: a forward pre-hook on its attention module's
output projection, whose input (B, T, H*D) is the heads' outputs side by side.

    hook_output(attention_module)        # retrofit.patch, once the norm is the module's `retrofit` child
    drop_output_hooks(module)            # retrofit.unpatch, on every module

The hooks hold no per-forward state, so concurrent forwards of one model (threads) cannot see each other's: the
projection's hook is bound to the owner (ProjectionHook) and reads the owner's child when it runs.
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict

from torch import nn

from ..families import output_projection
from .base import CHILD, Norm

_REGISTER = threading.Lock()  # held only while follow_projection adds a hook (never on a plain forward)


def hook_output(owner: nn.Module) -> None:
    """Normalize `owner`'s output-projection input by its `retrofit` child from now on (retrofit.patch calls this)."""
    owner.register_forward_pre_hook(follow_projection)
    follow_projection(owner, ())


class ProjectionHook:
    """Forward pre-hook on an attention module's output projection, bound to that attention module (its owner).

    args[0] (B, T, H*D), heads concatenated, goes through the owner's child as it is *now* — the norm, PEFT's
    modules_to_save wrapper around it (whose active copy trains), or the trained copy merge_and_unload leaves in
    its place — as (B, T, H, D). It does nothing when the owner has no such child (the teacher bypass detaches
    it) or when this projection is no longer the owner's (PEFT wrapped it: the wrapper has its own hook).

    Bound to the owner rather than the norm: the norm keeps no reference to its owner (PEFT's modules_to_save
    deep-copies the norm alone), and nothing is handed from one hook to another, so concurrent forwards of one
    model share no state. A deepcopy of the model rebinds it to the copy's owner; a deepcopy of the projection
    alone (PEFT's modules_to_save on o_proj) gives an inert hook, so the input is normalized once, by the
    wrapper's."""

    __slots__ = ("owner",)

    def __init__(self, owner: nn.Module | None):
        self.owner = owner

    def __call__(self, projection: nn.Module, args):
        owner = self.owner
        if owner is None or not args or output_projection(owner) is not projection:
            return None
        child = owner._modules.get(CHILD)
        norm = child if isinstance(child, Norm) else getattr(child, "original_module", None)
        if not (isinstance(norm, Norm) and norm.acts_on_output):
            return None  # bypassed, or a norm that acts inside attention took this one's place
        x = args[0]
        heads = norm.shape.num_heads
        x = x.view(*x.shape[:-1], heads, x.shape[-1] // heads)
        return (norm.keep_unselected(child(x), x).reshape(args[0].shape), *args[1:])

    def __deepcopy__(self, memo):
        return ProjectionHook(memo.get(id(self.owner)))


def follow_projection(owner: nn.Module, args) -> None:
    """Forward pre-hook on an AVNorm owner: its *current* output projection carries a ProjectionHook bound to it.

    PEFT may wrap the projection after the patch (LoRA on o_proj must see the normalized input too), and an
    nn.DataParallel replica shares its original's hook table, whose hook is bound to the original owner: a replica
    gets a table of its own, so each replica normalizes with its own norm. Changes the model only then (under a
    lock: two threads must not both add one); on every other forward it only looks."""
    projection = output_projection(owner)
    if projection is None or _bound(projection, owner):
        return None
    with _REGISTER:
        if _bound(projection, owner):
            return None
        if getattr(projection, "_is_replica", False):
            projection._forward_pre_hooks = OrderedDict(
                (k, h) for k, h in projection._forward_pre_hooks.items() if not isinstance(h, ProjectionHook))
        if not any(isinstance(h, ProjectionHook) and h.owner is owner for h in projection._forward_pre_hooks.values()):
            projection.register_forward_pre_hook(ProjectionHook(owner))
        if _unmarked(projection):
            projection.forward = types.MethodType(type(projection).forward, projection)  # see _unmarked
    return None


def _bound(projection: nn.Module, owner: nn.Module) -> bool:
    hooked = any(isinstance(h, ProjectionHook) and h.owner is owner for h in projection._forward_pre_hooks.values())
    return hooked and not _unmarked(projection)


def _unmarked(projection: nn.Module) -> bool:
    """Whether a hooked projection still lacks the mark torch.compile tells it from an unhooked one by.

    Dynamo does not guard on a module's hooks (torch._dynamo.config.skip_nnmodule_hook_guards, True by default), so
    a graph traced through an unpatched model of the same class would run here without the norm, and a graph traced
    through this one would run on an unpatched model. It does guard on whether a module has a `forward` of its own
    (`not ___dict_contains('forward', ...)`): the mark is the class's forward bound to the projection, which runs
    exactly what the class's would. A replica's copy, bound to its original, or none at all: unmarked; another
    owner's forward (accelerate's hooks, say) is left alone. retrofit.unpatch removes the mark (drop_output_hooks)."""
    forward = projection.__dict__.get("forward")
    return forward is None or _is_mark(forward) and forward.__self__ is not projection


def _is_mark(forward) -> bool:
    return isinstance(forward, types.MethodType) and isinstance(forward.__self__, nn.Module) and \
        forward.__func__ is type(forward.__self__).forward


def drop_output_hooks(module: nn.Module) -> None:
    """Remove the acts_on_output hooks from `module`, and the mark from a projection that had one (retrofit.unpatch)."""
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is follow_projection or isinstance(hook, ProjectionHook):
            del module._forward_pre_hooks[key]
            if isinstance(hook, ProjectionHook) and _is_mark(module.__dict__.get("forward")):
                del module.__dict__["forward"]
