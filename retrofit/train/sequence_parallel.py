"""Ulysses sequence parallelism: N processes share every row, each holding T/N of its tokens.

    torchrun --nproc_per_node 4 -m retrofit train RECIPE train.sequence_parallel=2   # 2 groups of 2

    layout = sequence_layout(2)                 # under torch.distributed: groups of 2 consecutive ranks
    with sharded(model, layout):                # attention sees the whole row, for H/N heads
        loss = loss_sum(model, shard(batch, layout), "lm")   # this rank's T/N tokens, scored on the global labels
        loss.backward()

Everything but attention works per token, so each rank runs embeddings, MLPs, norms and the head on its own
T/N tokens (activations shrink N-fold). Around attention two all-to-alls move between layouts (DeepSpeed
Ulysses, arXiv 2309.14509):

    q, k, v (B, H, T/N, D)  --all-to-all-->  (B, H/N, T, D)   every key of the row, this rank's heads
    the model's own attention function (sdpa, eager, retrofit's norms) runs there, unchanged
    out (B, T, H/N, D)      --all-to-all-->  (B, T/N, H, D)   back to this rank's tokens, every head

So a norm runs exactly as on one process: p-softmax's normalizer, SSMax's n and softmax+1's sink see every key.
Per-head tensors of the norm (SSMax's s, softmax+1's sink, AVNorm beyond's exponents, a heads= selection, a
model's own sinks) are sliced to the rank's heads as views, so their gradients flow back into the full
parameter. AVNorm (mode=always) acts per token on the output projection's input: it needs nothing.
GQA: key/value heads are repeated (the fewest times) until the ranks divide them.

Two all-to-alls do the moving. Under DDP and train.fsdp, retrofit's own: `torch.distributed.all_to_all_single`
(gloo on CPU, NCCL on GPU) in a five-line autograd function (an all-to-all of equal chunks is its own adjoint).
Under DeepSpeed (train.deepspeed or an accelerate DeepSpeed config), DeepSpeed's ALST: accelerate's
`ParallelismConfig(sp_backend="deepspeed")` registers UlyssesSPAttentionHF around `alst_attention` (train/alst.py),
which adds only what ALST lacks, the norm's per-head tensors sliced to the rank's heads. ALST runs only inside a
DeepSpeed engine (its groups go to deepspeed.initialize), so retrofit's all-to-all stays for the other two engines;
torch's own context parallel is ring attention, without a per-row hook for a norm's correction.
Seam: an attention implementation registered with transformers (as retrofit.patch does) and, under the same
name, a mask function that lets only plain causal rows through (a padding or packed-document mask over a shard
would be wrong, silently).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention_modules import attention_modules
from ..attention_seam import eager_attention_of
from ..errors import RetrofitError
from ..norms.attention_call import SINK_KWARGS
from ..norms.base import CHILD

NAME = "retrofit_ulysses"     # the attention implementation while a model runs sharded (retrofit's all-to-all)
ALST_NAME = "retrofit_alst"   # ... under DeepSpeed: ALST's all-to-all around alst_attention
STATE = "_retrofit_sequence"  # on each attention module while sharded: (layout, the implementation it wraps)


@dataclass(frozen=True)
class SequenceLayout:
    """Where this process sits: `size` processes share each row (its sequence group); `data_size` groups."""

    size: int                      # N: processes per sequence group
    rank: int                      # this process's part of each row (0..N-1)
    data_rank: int                 # which sequence group: the data-parallel index
    data_size: int                 # how many groups (data-parallel processes)
    group: object = None           # the process group of this sequence group
    alst: bool = False             # DeepSpeed's ALST moves the heads (its own groups), not retrofit's all-to-all

    def part(self, length: int) -> slice:
        """This rank's tokens of a row of `length` tokens."""
        if length % self.size:
            raise RetrofitError(f"sequence length {length} is not a multiple of train.sequence_parallel "
                                f"{self.size}: choose data.seq_len (and train.init_len) divisible by it")
        n = length // self.size
        return slice(self.rank * n, (self.rank + 1) * n)


def sequence_layout(size: int, alst: bool = False) -> SequenceLayout | None:
    """Groups of `size` consecutive ranks (one node's GPUs share a row); None when size is 1. alst: under
    DeepSpeed, whose ALST makes the same groups itself (parallel_state_sp: consecutive ranks)."""
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % size:
        raise RetrofitError(f"train.sequence_parallel {size} does not divide the {world} process(es): launch "
                            f"a multiple of {size} (torchrun --nproc_per_node {size})")
    rank = dist.get_rank()
    if alst:
        return SequenceLayout(size, rank % size, rank // size, world // size, alst=True)
    if size == world:  # one group: the default one (DDP's collectives share it, as SyncBatchNorm's do)
        return SequenceLayout(size, rank, 0, 1, dist.group.WORLD)
    # Several groups: every rank creates every group. torch names groups by a counter it resets when the default
    # group is destroyed, so a second run in one launch would meet the first run's rendezvous keys on the store:
    # launch one run per process when groups are several.
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
    return SequenceLayout(size, rank % size, rank // size, world // size, groups[rank // size])


def plan_sequence_layout(recipe, alst: bool = False) -> SequenceLayout | None:
    """The layout train.sequence_parallel asks for (None when 1), after refusing what it cannot run (one line);
    alst: DeepSpeed runs the model (its ALST moves the heads)."""
    size = recipe.train.sequence_parallel
    if size == 1:
        return None
    if recipe.data.task == "counting":
        raise RetrofitError("train.sequence_parallel trains the lm and passkey tasks; counting's regression head "
                            "is not sharded: set train.sequence_parallel to 1")
    if recipe.data.packing == "documents":
        raise RetrofitError("train.sequence_parallel runs whole rows of plain causal attention: data.packing "
                            "documents (attention within each document) is not supported with it yet; use concat")
    recovery = recipe.section("recovery")
    if recovery is not None and recovery.distills():
        raise RetrofitError("train.sequence_parallel does not shard the recovery teacher (kl_weight, match_steps) "
                            "yet: drop them or set train.sequence_parallel to 1")
    for length in {recipe.data.seq_len, recipe.train.init_len or recipe.data.seq_len}:
        if length % size:
            raise RetrofitError(f"data.seq_len / train.init_len {length} is not a multiple of "
                                f"train.sequence_parallel {size}")
    return sequence_layout(size, alst)


# ---- the batch -------------------------------------------------------------------------------------------------------

def shard(batch: dict, layout: SequenceLayout) -> dict:
    """This rank's tokens of (B, T) rows: input_ids, global position_ids, and `shift_labels` (labels shifted over
    the whole row, so the token after a shard boundary is scored where it belongs: transformers' own name)."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    where = layout.part(length)
    positions = batch.get("position_ids")
    if positions is not None and not torch.equal(positions, torch.arange(length).expand_as(positions)):
        raise RetrofitError("train.sequence_parallel runs whole rows of plain causal attention: packed "
                            "documents (position_ids that restart) are not supported with it yet")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise RetrofitError("train.sequence_parallel runs whole rows of plain causal attention: padded rows "
                            "(an attention_mask with zeros) are not supported with it")
    part = {"input_ids": ids[:, where],
            "position_ids": torch.arange(length, device=ids.device)[where].expand(rows, -1)}
    if "labels" in batch:
        shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # position t scores t+1
        part["shift_labels"] = shifted[:, where]
    return part


# ---- the model -------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def sharded(model: nn.Module, layout: SequenceLayout | None):
    """Run `model`'s attention sequence-parallel inside the block (forward and backward, including the recompute
    of gradient checkpointing); outside it the model is exactly as before (evaluation, saving)."""
    if layout is None:
        yield model
        return
    inner = inner_model(model)
    config = inner.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise RetrofitError(f"train.sequence_parallel does not support {config.model_type}'s sliding-window "
                            "attention yet (its window mask would be dropped): set it to 1")
    modules = [m for _, m in attention_modules(inner)]
    if not modules:
        raise RetrofitError(f"train.sequence_parallel found no attention module in {type(inner).__name__}")
    wrapped = config._attn_implementation
    heads = getattr(config, "num_attention_heads", None) or modules[0].num_heads
    if heads % layout.size:
        raise RetrofitError(f"{heads} attention heads cannot be split over train.sequence_parallel "
                            f"{layout.size} processes: choose a divisor of {heads}")
    groups = [m.__dict__.get("num_key_value_groups") for m in modules]  # ALST sets them for repeated KV heads
    for module in modules:
        module.__dict__[STATE] = (layout, wrapped)
    config._attn_implementation = ALST_NAME if layout.alst else NAME
    try:
        yield model
    finally:
        config._attn_implementation = wrapped
        for module, before in zip(modules, groups):
            module.__dict__.pop(STATE, None)
            if before is not None:
                module.num_key_value_groups = before


def inner_model(model: nn.Module) -> nn.Module:
    """The module whose config the attention modules read, inside DDP and a task wrapper (CountingModel.lm)."""
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "lm", model)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of equal chunks along dim 0; the backward is the same exchange (it is its own adjoint)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous (empty_like would copy x's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_from_sequence(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """(B, H, T/N, D) on each rank -> (B, H/N, T, D): this rank's heads over the whole row."""
    b, h, t, d = x.shape
    n = layout.size
    x = x.reshape(b, n, h // n, t, d).transpose(0, 1)             # (N, B, H/N, T/N, D): chunk j goes to rank j
    x = _AllToAll.apply(x, layout.group)                          # (N, B, H/N, T/N, D): chunk i = row part i
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def sequence_from_heads(x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """(B, T, H/N, D) on each rank -> (B, T/N, H, D): this rank's tokens, every head."""
    b, t, h, d = x.shape
    n = layout.size
    x = x.reshape(b, n, t // n, h, d).transpose(0, 1)             # (N, B, T/N, H/N, D): row part j goes to rank j
    x = _AllToAll.apply(x, layout.group)                          # (N, B, T/N, H/N, D): chunk i = head group i
    return x.permute(1, 2, 0, 3, 4).reshape(b, t // n, n * h, d)


def _per_head(name_tensor, num_heads: int) -> bool:
    _, t = name_tensor
    shape = getattr(t, "ds_shape", t.shape)  # a ZeRO-3 parameter is an empty placeholder outside its gather
    return len(shape) == 1 and shape[0] == num_heads


def _shadow(module: nn.Module, names: list[str], heads: slice) -> None:
    """The slices in the instance __dict__, where attribute lookup finds them before nn.Module's parameters and
    buffers: `norm.s` reads the slice while `norm._parameters["s"]` stays the parameter every wrapper sees."""
    for name in names:
        full = module._parameters[name] if name in module._parameters else module._buffers[name]
        module.__dict__[name] = full[heads]


def _unshadow(module: nn.Module, names: list[str]) -> None:
    for name in names:
        module.__dict__.pop(name, None)


def on_heads(module: nn.Module, heads: slice, num_heads: int, call):
    """`call()` with the module's norm child seeing only `heads` of its per-head (H,) tensors; slices are views,
    so gradients reach the full parameters. A ZeRO-3 parameter is sliced once DeepSpeed has gathered it for its
    module's call (a pre-hook registered after DeepSpeed's), so it stays the parameter DeepSpeed's hooks know."""
    child = module._modules.get(CHILD)
    if child is None:
        return call()
    now, gathered, handles = [], [], []
    for owner in child.modules():
        tensors = [*owner._parameters.items(), *owner._buffers.items()]
        names = [n for n, t in tensors if t is not None and _per_head((n, t), num_heads)]
        late = [n for n in names if hasattr(owner._parameters.get(n), "ds_id")]
        now.append((owner, [n for n in names if n not in late]))
        if late:
            gathered.append((owner, late))
            handles.append(owner.register_forward_pre_hook(lambda m, args, late=late: _shadow(m, late, heads)))
            handles.append(owner.register_forward_hook(lambda m, args, out, late=late: _unshadow(m, late)))
    try:
        for owner, names in now:
            _shadow(owner, names, heads)
        return call()
    finally:
        for handle in handles:
            handle.remove()
        for owner, names in now + gathered:
            _unshadow(owner, names)


def _base_function(module: nn.Module, name: str):
    if name == "sdpa":
        return sdpa_attention_forward
    if name == "eager":
        return eager_attention_of(module)
    return ALL_ATTENTION_FUNCTIONS[name]


@contextlib.contextmanager
def _kv_groups(module: nn.Module, groups: int):
    """The query heads per key/value head after repeating (transformers' eager repeat_kv reads the module's)."""
    before = module.__dict__.get("num_key_value_groups")
    if before is None or before == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = before


def layout_of(module: nn.Module, name: str):
    state = module.__dict__.get(STATE)
    if state is None:
        raise RetrofitError(f"{name} runs only inside retrofit.train.sequence_parallel.sharded(model, layout)")
    return state


def on_my_heads(module, q, k, v, kwargs: dict, rank: int, size: int, wrapped: str) -> torch.Tensor:
    """The wrapped implementation on this rank's heads of the whole row: q (B, H/N, T, D), k/v (B, Hkv', T, D) ->
    (B, T, H/N, D). The rank's heads are the N-th block `rank` of H (both all-to-alls, retrofit's and DeepSpeed's,
    hand them out so); per-head tensors (the norm's, a model's own sinks) are sliced to it."""
    local = q.shape[1]
    heads, mine = local * size, slice(rank * local, (rank + 1) * local)
    for name in SINK_KWARGS:  # a model's own per-head sinks (gpt_oss)
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][mine]
    mask = None  # plain causal (ulysses_mask let nothing else through): sdpa-based functions take None as causal
    base = _base_function(module, wrapped)
    if wrapped in ("eager", "retrofit_eager"):  # eager adds the mask it is given: build the causal one
        length = q.shape[2]
        mask = torch.full((length, length), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)
        mask = mask[None, None]                                    # (1, 1, T, T) additive
    with _kv_groups(module, local // k.shape[1]):
        out, _ = on_heads(module, mine, heads, lambda: base(module, q, k, v, mask, **kwargs))  # (B, T, H/N, D)
    return out


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature; query (B, H, T/N, D), key/value (B, Hkv, T/N, D) ->
    ((B, T/N, H, D), None): the wrapped implementation runs on (B, H/N, T, D) for this rank's heads."""
    layout, wrapped = layout_of(module, NAME)
    n, kv_heads = layout.size, key.shape[1]
    repeat = n // math.gcd(kv_heads, n)  # the fewest copies of each KV head that N divides
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    q, k, v = (heads_from_sequence(x, layout) for x in (query, key, value))
    out = on_my_heads(module, q, k, v, kwargs, layout.rank, n, wrapped)
    return sequence_from_heads(out, layout), None


def ulysses_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                 allow_is_causal_skip=True, **kwargs):
    """The mask function under NAME: plain causal rows only (None = causal to every attention function here)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise RetrofitError("train.sequence_parallel runs whole rows of plain causal attention: padded rows "
                            "are not supported with it")
    if not allow_is_causal_skip or q_offset or kv_offset:
        raise RetrofitError("train.sequence_parallel runs whole rows of plain causal attention, without a cache, "
                            "packed documents or custom masks")
    return None


AttentionInterface.register(NAME, ulysses_attention)
AttentionMaskInterface.register(NAME, ulysses_mask)
