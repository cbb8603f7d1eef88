"""Which backend computes a call, and in which dtype (see the package docstring for the rules).

    with retrofit.kernels.force_backend("blockwise"):     # tests and benchmarks: one backend for every call
        out = psoftmax_attention(q, k, v, 2.0)

The forced name lives in a ContextVar, so it holds for the calls made inside the `with` on this thread
(and in tasks copied from its context) and never leaks into another thread or test. The backward of a
call uses the backend its forward used (the custom op records the name), wherever it runs.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from . import blockwise, cpu_fused, cuda_fused, decode, flex

BACKENDS = ("blockwise", "cpu_fused", "decode", "triton", *cuda_fused.KERNELS, "flex")
# On CUDA, the first backend of a norm's list that takes a call computes it ("softmax": psoftmax_attention at p = 1;
# "psoftmax": any other p). Measured on an H100 (docs/results/gpu-h100/): flash and Triton pass parity and train at
# >= 0.87x unpatched tokens/s; cuda_efficient's backward crashed there (retrofit's `out` layout, fixed since:
# kernels/cuda_fused.py) and FlexAttention was unverified on CUDA, so neither is chosen here (both can be forced).
CUDA_ORDER = {"softmax": ("cuda_flash", "triton"), "psoftmax": ("triton", "cuda_flash"),
              "ssmax": ("cuda_flash", "triton"), "softmax1": ("cuda_flash", "triton")}
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("retrofit_kernels_backend", default=None)
_TRITON_UNSET = object()
_triton = _TRITON_UNSET  # the module, imported once on first use (importing retrofit never needs Triton)


@contextlib.contextmanager
def force_backend(name: str | None):
    """Route every kernel call inside the block to backend `name` (None: choose per call, the default).

    Calls with dropout or soft-capping still go to blockwise (the one backend that implements both).
    """
    if name is not None and name not in BACKENDS:
        raise ValueError(f"force_backend: unknown backend {name!r}; choose from {', '.join(BACKENDS)} or None")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


@torch.compiler.assume_constant_result  # Dynamo cannot trace ContextVar.get: the name is read once, at trace time
def forced() -> str | None:
    return _FORCED.get()


def triton_backend():
    """retrofit.kernels.triton_psoftmax when Triton imports, else None."""
    global _triton
    if _triton is _TRITON_UNSET:
        try:
            from . import triton_psoftmax
            _triton = triton_psoftmax if triton_psoftmax.AVAILABLE else None
        except Exception:  # a broken Triton install must not break the CPU path
            _triton = None
    return _triton


def module(name: str):
    """The backend module for a name that `choose` returned."""
    if name == "triton":
        return triton_backend()
    if name in cuda_fused.KERNELS:
        return cuda_fused.KERNELS[name]
    return {"blockwise": blockwise, "cpu_fused": cpu_fused, "decode": decode, "flex": flex}[name]


def takes(name: str, q, k, v, mask, causal: bool) -> bool:
    """Whether backend `name` computes this call (q, k, v in the compute dtype) exactly."""
    if name == "triton":
        return triton_backend() is not None and triton_backend().supports(q, v, mask)
    if name == "cpu_fused":
        return cpu_fused.available(q, v)
    if name in cuda_fused.KERNELS or name == "flex":
        return module(name).supports(q, k, v, mask, causal)
    return True  # blockwise and decode take everything


def choose(q, k, v, p: float, mask, dropout: bool, softcap, causal: bool = True, norm: str | None = None) -> str:
    """The backend for one call (q, k, v already in the compute dtype) of `norm` (a CUDA_ORDER key; None: softmax
    for p = 1, else psoftmax)."""
    if dropout:  # the one backend that regenerates the dropout mask in its backward
        return "blockwise"
    name = forced()
    if softcap is not None:  # blockwise and decode cap the logits; the fused CPU and Triton kernels cannot
        return "decode" if name == "decode" or (name is None and decode.suits(q, k)) else "blockwise"
    if name is not None:
        _check_forced(name, q, k, v, p, mask, causal)
        return name
    if q.shape[2] == 0 or k.shape[2] == 0:  # nothing to attend: blockwise returns zeros (fused CPU op crashes)
        return "blockwise"
    if decode.suits(q, k):
        # softmax (p = 1) on CPU: PyTorch's fused flash kernel spreads one decode row's keys over the threads, the
        # decode path's two bmm's do not (SmolLM2 shapes, 2048 keys, 2 threads: 190 vs 220 us a call; 1 thread: equal)
        return "cpu_fused" if p == 1.0 and cpu_fused.available(q, v) else "decode"
    if q.is_cuda:
        for name in CUDA_ORDER[norm or ("softmax" if p == 1.0 else "psoftmax")]:
            if takes(name, q, k, v, mask, causal):
                return name
    if p == 1.0 and cpu_fused.available(q, v):
        return "cpu_fused"
    return "blockwise"


def _check_forced(name: str, q, k, v, p: float, mask, causal: bool) -> None:
    """A forced backend that cannot compute this call is an error, never a silently different computation."""
    if name == "cpu_fused" and p != 1.0:
        raise ValueError(f"force_backend('cpu_fused') computes softmax only (p = 1), not p = {p:g}: "
                         "force 'blockwise' or 'decode' for p != 1")
    if name == "cpu_fused" and not cpu_fused.available(q, v):
        raise ValueError(f"force_backend('cpu_fused') needs CPU tensors with equal q and v head sizes; got "
                         f"{q.device.type} {q.dtype}, head sizes {q.shape[-1]} and {v.shape[-1]}")
    if name == "triton" and (triton_backend() is None or not triton_backend().supports(q, v, mask)):
        raise ValueError("force_backend('triton') needs Triton and CUDA tensors (or CPU tensors under "
                         "TRITON_INTERPRET=1) of fp16/bf16/fp32 with head size <= 256")
    if (name in cuda_fused.KERNELS or name == "flex") and not takes(name, q, k, v, mask, causal):
        raise ValueError(f"force_backend({name!r}) cannot compute this call ({q.device.type} {q.dtype}, head size "
                         f"{q.shape[-1]}, q {q.shape[2]} x k {k.shape[2]}, mask {mask is not None}, causal {causal}): "
                         "see retrofit/kernels/cuda_fused.py and flex.py for what each takes")


def compute_dtype(q, k, v) -> torch.dtype:
    """Under autocast for q's device the autocast dtype (fp64 inputs stay fp64, which autocast never casts);
    otherwise the widest of the three (mixed dtypes are upcast, as SDPA accepts them)."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if autocast_on(q.device.type):
        low = torch.get_autocast_dtype(q.device.type)
        dtypes = tuple(d if d == torch.float64 else low for d in dtypes)
    return torch.promote_types(torch.promote_types(dtypes[0], dtypes[1]), dtypes[2])


def autocast_on(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return False


def no_autocast(device_type: str):
    """Autocast off for this device if it is on: the kernels choose their own precision, and the blockwise
    worker threads would not inherit it anyway (so the calling thread's ops must not depend on it either)."""
    return torch.autocast(device_type, enabled=False) if autocast_on(device_type) else contextlib.nullcontext()
