"""Peak memory while a block of code runs: one measurement for evaluation and the benchmarks.

    with PeakMemory("cpu") as memory:
        model(ids)
    memory.start_mb, memory.peak_mb, memory.added_mb

- CUDA: the caching allocator's peak (`max_memory_allocated`), reset on entry.
- Linux CPU: the kernel's resident-set high-water mark (VmHWM), reset to the current resident set
  on entry through /proc/self/clear_refs. Exact: no sampling interval to miss a short spike.
- Elsewhere (or where clear_refs is not writable): the resident set sampled every 10 ms.

On the CPU the numbers are the whole process's resident memory, model weights included; freed heap
is handed back to the OS on entry (malloc_trim), so one block's peak does not leak into the next.

    check_fits(config, tokens=seq_len * micro_batch, training=True, device="cpu", lower="data.seq_len ...")

refuses, before anything is allocated, a forward whose activations cannot fit in the memory available now.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch


def status_mb(key: str) -> float:
    """A /proc/self/status memory line (VmRSS, VmHWM, ...) in MiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def rss_mb() -> float:
    """The process's resident set now, MiB."""
    if sys.platform.startswith("linux"):
        return status_mb("VmRSS")
    import psutil  # ships with accelerate

    return psutil.Process().memory_info().rss / 2 ** 20


def _libc():
    """glibc, or None (another C library or OS)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


# glibc's malloc returns a freed block to the OS at once only above its mmap threshold, and it raises that threshold
# to the size of each mmapped block freed, up to 32 MiB. After the first few activations are freed, every tensor
# under 32 MiB comes from the heap and, once freed, stays resident between live ones: a training step's recomputed
# and transient activations. Measured (SmolLM2's widths, 8 layers, 4,096 tokens, gradient checkpointing): 422 MiB
# of freed memory resident after the forward, +170 MiB on the step's peak; a fixed threshold removes both.
MMAP_THRESHOLD_BYTES = 2 ** 20


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for the rest of the process (mallopt M_MMAP_THRESHOLD), so tensors of
    `threshold` bytes or more go back to the OS when freed. True when set (Linux, glibc)."""
    libc = _libc() if sys.platform.startswith("linux") else None
    mallopt = getattr(libc, "mallopt", None)
    return bool(mallopt(-3, int(threshold))) if mallopt else False  # -3: M_MMAP_THRESHOLD


def _clear_refs_works() -> bool:
    return sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)


class PeakMemory:
    """Context manager: start_mb (on entry), peak_mb (highest during the block), added_mb (their difference).
    `kind` is "cuda_allocated" or "rss"; `method` says how the peak was taken."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.kind = "cuda_allocated" if self.cuda else "rss"
        self.hwm = not self.cuda and _clear_refs_works()
        self.method = ("cuda max_memory_allocated" if self.cuda else
                       "VmHWM after clear_refs" if self.hwm else "RSS sampled every 10 ms")
        self.start_mb = self.peak_mb = 0.0
        self._stop = self._thread = None

    @property
    def added_mb(self) -> float:
        return self.peak_mb - self.start_mb

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_mb = self.peak_mb = torch.cuda.memory_allocated() / 2 ** 20
            return self
        libc = _libc()
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
        if self.hwm:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        self.start_mb = self.peak_mb = rss_mb()
        if not self.hwm:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak_mb = max(self.peak_mb, rss_mb())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = torch.cuda.max_memory_allocated() / 2 ** 20
        elif self.hwm:
            self.peak_mb = max(self.start_mb, status_mb("VmHWM"))
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, rss_mb())


def available_bytes(device="cpu") -> int:
    """Memory free for new tensors now: the CUDA device's free memory, else the machine's available RAM."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]
    import psutil  # ships with accelerate

    return psutil.virtual_memory().available


def activation_bytes(config, tokens: int, *, training: bool, dtype_bytes: int = 4,
                     checkpointing: bool = False, chunk_tokens: int = 1024) -> int:
    """A lower bound on the activation memory of one forward over `tokens` tokens (batch x length).

    Inference (evaluation scores the logits in chunks, so they are not counted): the residual stream and a
    few hidden-size tensors plus the MLP's hidden of the layer being run. Training keeps, per layer, at least
    the residual input, q/k/v, the attention output and the MLP's input and hidden (~6 x hidden +
    intermediate per token; only the layer inputs under gradient checkpointing), and one chunk of logits with
    its fp32 copy for the loss (chunk_tokens positions: train.loss_chunk_tokens; 0 = every token's). The
    attention the kernels keep is O(T) (a log-sum-exp per head and query), so it is counted per token too.
    Deliberately low: a run this refuses cannot fit; one it lets through may still need more."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    inner = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
    layer = (6 * hidden + inner + heads) * dtype_bytes  # what one layer keeps for its backward
    logits = min(int(tokens), chunk_tokens or int(tokens)) * vocab * (dtype_bytes + 4) if training else 0
    if training and checkpointing:
        per_token = layers * hidden * dtype_bytes + layer
    elif training:
        per_token = layers * layer
    else:
        per_token = (4 * hidden + inner + heads) * dtype_bytes
    return int(tokens) * per_token + logits


def check_fits(config, tokens: int, *, training: bool, device="cpu", what: str = "", lower: str = "",
               dtype_bytes: int = 4, checkpointing: bool = False, chunk_tokens: int = 1024) -> None:
    """Refuse (one-line RetrofitError naming the numbers) activations that cannot fit in available memory."""
    from .errors import RetrofitError

    need = activation_bytes(config, tokens, training=training, dtype_bytes=dtype_bytes, checkpointing=checkpointing,
                            chunk_tokens=chunk_tokens)
    free = available_bytes(device)
    if need > free:
        gib = 2 ** 30
        raise RetrofitError(
            f"{what or 'this run'}: {tokens:,} tokens per forward need at least {need / gib:,.1f} GiB of activations "
            f"({getattr(config, 'num_hidden_layers', '?')} layers, hidden {getattr(config, 'hidden_size', '?')}, "
            f"vocab {getattr(config, 'vocab_size', '?')}), but only {free / gib:,.1f} GiB is available on "
            f"{torch.device(device).type}; lower {lower or 'the length or the batch'}")


# ---- planning a training run: `retrofit train --dry-run` ---------------------------------------------------------

# What a CPU training process adds to its resident set once steps run, beyond tensors: autograd's and the BLAS /
# oneDNN workspaces and glibc's arenas. Measured once freed activations go back to the OS (return_freed_memory):
# 24-34 MiB on the tests' tiny models (tests/train/test_chunked_loss.py); 120 MiB before, which was mostly freed memory.
CPU_RUNTIME_BYTES = 32 * 2 ** 20


def count_parameters(config) -> int:
    """The parameter count of the causal LM `config` describes (built on the meta device: no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors once


def _layer_floats(config) -> int:
    """Floats per token one decoder layer keeps for its backward (Llama-style block, sdpa): both norms' input, the
    normalized value and its weighted copy (2 x 3d), q, k, v and the RoPE'd q, k, the key/value heads repeated to
    the query heads and the attention output with its transposed copy (~6d + 3 kv), the MLP's gate, activation, up
    and product (4 x intermediate), a log-sum-exp per head."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = hidden * int(getattr(config, "num_key_value_heads", 0) or heads) // max(heads, 1)
    inner = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
    return 12 * hidden + 3 * kv + 4 * inner + heads


def _loss_bytes(config, act: int) -> int:
    """Bytes per token the loss moment holds beside the residual stream: the final norm's output (the head's input,
    fp32) and its autocast copy (act; none in fp32), the gradient of the final hidden accumulating over the loss's
    chunks (fp32), RoPE's cos and sin (fp32, head_dim each) and the token ids, labels and positions (int64). Measured
    on the CPU's live tensors, bf16 autocast, SmolLM2's widths: 7.3 KiB a token beside the residual stream; this
    gives 6.3."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0) or 1
    head_dim = int(getattr(config, "head_dim", 0) or 0) or hidden // heads
    return (8 + (act % 4)) * hidden + 8 * head_dim + 24


def plan_training(config, params: int, *, tokens: int, rows: int = 1, precision: str = "fp32",
                  checkpointing: bool = False, chunk_tokens: int = 1024, trainable: int | None = None,
                  process_bytes: int | None = None) -> dict:
    """Predicted peak memory (bytes) of a training step of retrofit's loop (from its second step: AdamW's moments
    exist), by part, and "total" (the peak, not the parts' sum).

    Always held: process (the resident set before the model loads; process_bytes=0 on CUDA, whose allocator counts
    tensors only), runtime (on the CPU, the workspaces a step adds: CPU_RUNTIME_BYTES), weights (fp32 master
    weights) and optimizer (AdamW's two fp32 moments per trainable parameter). The loop sets gradients to None
    after each step, so the backward's peak is the larger of two moments (activations in the activation dtype):
    - loss: backward starts at the loss, holding every activation saved for backward ("activations": under
      gradient checkpointing each layer's input, else every layer's _layer_floats; plus the final hidden), the
      head's gradient ("head_gradient": vocab x hidden fp32, the only gradient made yet) and one chunk of logits
      three times over in fp32 ("logits": the recomputed log-softmax, its gradient and the logits' gradient;
      `chunk_tokens` positions, 0 = the whole batch: train.loss_chunk_tokens; plus the bf16 head output);
    - layers: the backward's end, holding every gradient ("gradients", fp32) and, under gradient checkpointing, the
      first layer recomputed ("recompute": _layer_floats per token; its gradients fit in what its backward frees
      as it goes: measured on a tiny model whose peak is this moment, 2 x overshot by 24%); and under gradient
      checkpointing its start too: the last layer recomputed beside every other layer's saved input, the gradient
      of its output and the head's gradient (the peak from a few thousand tokens on: width 256, 8 layers, bf16,
      16K tokens measured 0.82 of the peak without it).
    Tensors freed in between go back to the OS on the CPU (return_freed_memory; without it glibc kept +2 GiB
    resident for SmolLM2-135M at 8K). The residual stream (each layer's input, what gradient checkpointing keeps, and
    the final hidden) is fp32 whatever the precision: the master weights are fp32, so under bf16/fp16 autocast only
    the matrix products' outputs are half precision (planning it in bf16 predicted 0.68 of an H100's measured peak
    for SmolLM2-135M at 32K tokens, docs/results/gpu-h100/run2)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    act = 2 if precision in ("bf16", "fp16") else 4
    trainable = params if trainable is None else trainable
    per_layer = _layer_floats(config) * act
    residual = 4  # fp32: see the docstring
    saved = (layers + 1) * hidden * residual if checkpointing else layers * per_layer + hidden * residual
    saved += _loss_bytes(config, act)
    chunk = tokens if not chunk_tokens else min(tokens, max(1, chunk_tokens // rows) * rows)
    cpu = process_bytes is None
    parts = {"process": rss_bytes() if cpu else process_bytes, "runtime": CPU_RUNTIME_BYTES if cpu else 0,
             "weights": params * 4, "optimizer": trainable * 8,
             "activations": tokens * saved, "head_gradient": vocab * hidden * 4 if trainable == params else 0,
             "logits": chunk * vocab * (3 * 4 + (act % 4)),
             "gradients": trainable * 4, "recompute": tokens * per_layer if checkpointing else 0}
    held = parts["process"] + parts["runtime"] + parts["weights"] + parts["optimizer"]
    loss = parts["activations"] + parts["head_gradient"] + parts["logits"]
    layers_end = parts["gradients"] + parts["recompute"]
    # under checkpointing, the backward's first layer: its recompute beside every other layer's saved input, the
    # gradient of its output (fp32) and the head's gradient; past a few thousand tokens this is the step's peak
    layers_start = (tokens * layers * hidden * residual + parts["recompute"] + tokens * hidden * 4
                    + parts["head_gradient"]) if checkpointing else 0
    parts["total"] = held + max(loss, layers_end, layers_start)
    return parts


def rss_bytes() -> int:
    return int(rss_mb() * 2 ** 20)
