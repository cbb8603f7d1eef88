"""Kernel parity suite for `retrofit bench gpu`: every norm's kernel against a float64 reference, forward and backward.

    from retrofit.bench.parity import run_suite
    report = run_suite("cuda")          # {"checks": [...], "passed": n, "failed": n, "skipped": n, ...}
    report = run_suite("cpu", tiny=True)

Each check is one (norm, dtype, case, backend): q, k, v (and SSMax's s / softmax+1's sink) from a seeded
generator, the kernel's output and its gradients for a seeded grad_out, compared with `reference` below,
computed in float64 from the same (already rounded) inputs. The error of each tensor is max|x - ref| /
max|ref| (relative to the tensor's scale, so p-softmax's larger outputs are judged alike); a check passes
when every error is at most TOLERANCE[dtype] and every value is finite. Before each call, NaN-filled
buffers of the outputs' sizes are allocated and freed, so the caching allocator hands NaN memory to the
kernel's torch.empty: an element a kernel forgets to write shows up as NaN (reliable on CUDA; on CPU the
allocator may or may not reuse them).

Backends: `dispatch` (what retrofit.kernels picks), and each one forced: `triton` and `blockwise` on
CUDA, `cpu_fused` (p = 1 norms) and `blockwise` on CPU. A backend that cannot take a case (Triton with a
head size it lacks, the fused CPU kernel with p != 1) is recorded as skipped with the reason.

The reference is written from the formulas (retrofit.kernels' docstring), not from the kernels' code:
weights A = f(s) over the visible keys with s = scale q k^T + additive mask, then out = A v; a row with
no visible key gives 0. It materializes (B, H, Tq, Tk) in float64: sizes here stay small.
"""

from __future__ import annotations

import math
import time

import torch

NORMS = {  # name -> (kernel, p, per-head parameter)
    "softmax": ("psoftmax", 1.0, None),
    "psoftmax": ("psoftmax", 2.0, None),
    "psoftmax-p3": ("psoftmax", 3.0, None),
    "ssmax": ("ssmax", 1.0, "s"),
    "softmax1": ("softmax1", 1.0, "sink"),
}
DTYPES = ("bfloat16", "float16", "float32")  # bf16 first: on a GPU it is what matters most
# Relative error allowed (max|x - ref| / max|ref|), outputs and gradients. fp32: accumulation-order noise.
# fp16 (10-bit mantissa) and bf16 (7-bit): inputs are rounded before the reference sees them, so what is
# left is the kernel's own rounding (the weights cast to the input dtype before A v, the gradients' casts).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}
# Full: lengths that are multiples of 16 (Triton specializes integer arguments on it: fewer compilations) but of
# no block size (32, 64, 128), so partial blocks get tested; the chunk has Tq = T // 3 = 112 queries.
SIZES = {"full": dict(B=2, H=4, T=336, D=64, decode_keys=528), "tiny": dict(B=2, H=4, T=24, D=16, decode_keys=37)}
CASES = ("causal", "bool-mask", "additive-mask", "gqa", "decode", "chunk")


def reference(q, k, v, norm: str, param=None, *, p: float = 1.0, causal: bool = True, mask=None, scale=None):
    """float64 attention from the formulas: q (B, H, Tq, D), k/v (B, Hkv, Tk, D) -> (B, H, Tq, D)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)  # GQA
    scale = D ** -0.5 if scale is None else scale
    allowed = torch.ones(B, H, Tq, Tk, dtype=torch.bool, device=q.device)
    bias = torch.zeros(B, H, Tq, Tk, dtype=torch.float64, device=q.device)
    if causal:  # bottom-right: query i sits at position Tk - Tq + i
        allowed = allowed & torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:  # additive: the dtype's minimum or -inf hides a key
        allowed = allowed & (mask > torch.finfo(mask.dtype).min)
        bias = bias + torch.where(allowed, mask.double(), 0.0)
    if norm == "ssmax":  # q scaled by s_h * log(n), n = keys this query may see
        n = allowed.sum(-1, keepdim=True).clamp_min(1).double()
        q = q * param.double().view(1, H, 1, 1) * torch.log(n)
    s = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(~allowed, -math.inf)  # (B, H, Tq, Tk)
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)  # a row with no visible key: m = 0, weights 0
    e = torch.exp(s - m)
    if norm == "softmax1":  # exp(s) / (exp(b_h) + sum exp(s))
        sink = param.double().view(1, H, 1, 1)
        w = e / (torch.exp(sink - m) + e.sum(-1, keepdim=True))
    else:  # p-softmax, p = 1 softmax: exp(s) / ||exp(s)||_p
        w = e / (e ** p).sum(-1, keepdim=True).clamp_min(1e-300) ** (1.0 / p)
    return w @ v


def _inputs(case: str, dtype, device, size: dict, seed: int):
    """q, k, v, causal, mask for one case; seeded, so every backend sees the same numbers."""
    B, H, T, D = size["B"], size["H"], size["T"], size["D"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    Hkv, Tq, Tk, causal, mask = H, T, T, True, None
    if case in ("gqa", "decode"):
        Hkv = H // 2
    if case == "decode":  # one new token over a KV cache
        Tq, Tk = 1, size["decode_keys"]
    if case == "chunk":  # a prefill chunk after cached keys: Tq < Tk, bottom-right causal
        Tq = T // 3
    if case == "bool-mask":  # left padding on batch row 1 (its first rows see nothing) and random holes
        mask = torch.rand(B, 1, Tq, Tk, generator=g) > 0.2
        mask[1, :, :, : T // 4] = False
    if case == "additive-mask":  # not causal: a float bias in [-2, 0], some keys hidden with the dtype's minimum
        causal = False
        mask = -2 * torch.rand(B, 1, Tq, Tk, generator=g)
        mask = mask.masked_fill(torch.rand(B, 1, Tq, Tk, generator=g) < 0.2, torch.finfo(dtype).min).to(dtype)
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Tk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Tk, D, generator=g).to(dtype)
    grad = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    param = 0.3 + 0.4 * torch.rand(H, generator=g)  # SSMax s / softmax+1 sink, fp32 as a model's would be
    moved = [x.to(device) for x in (q, k, v, grad, param)]
    return (*moved, causal, None if mask is None else mask.to(device))


def _kernel(norm: str, q, k, v, param, causal, mask):
    import retrofit.kernels as K  # looked up per call: a test may plant a wrong kernel here

    kernel, p, _ = NORMS[norm]
    gqa = k.shape[1] != q.shape[1]
    if kernel == "psoftmax":
        return K.psoftmax_attention(q, k, v, p, causal=causal, attn_mask=mask, enable_gqa=gqa)
    if kernel == "ssmax":
        return K.ssmax_attention(q, k, v, param, causal=causal, attn_mask=mask, enable_gqa=gqa)
    return K.softmax1_attention(q, k, v, param, causal=causal, attn_mask=mask, enable_gqa=gqa)


def _poison(*like) -> None:
    """Allocate and free NaN buffers shaped like `like`: the allocator may hand them to the kernel's outputs."""
    buffers = [torch.full_like(x, math.nan) for x in like if x.is_floating_point()]
    del buffers


def _relative(x, ref) -> float:
    if x is None:
        return math.nan
    scale = ref.abs().max().item()
    return (x.double() - ref).abs().max().item() / max(scale, 1e-12)


def _skip_reason(backend: str, norm: str, q, k, v, mask, causal) -> str | None:
    import retrofit.kernels as K

    if backend == "cpu_fused" and NORMS[norm][1] != 1.0:
        return "the fused CPU kernel computes softmax only (p = 1)"
    if backend == "triton" and K.triton_backend() is None:
        return "Triton is not importable"
    if backend not in ("dispatch", "blockwise", "decode") and not K.dispatch.takes(backend, q, k, v, mask, causal):
        return f"{backend} does not take these inputs"
    return None


def check(norm: str, dtype: str, case: str, backend: str, device: str, size: dict, seed: int = 0) -> dict:
    """One parity check (see the module docstring); returns its row. Never raises: an exception is a failure."""
    import retrofit.kernels as K

    row = {"norm": norm, "dtype": dtype, "case": case, "backend": backend}
    q, k, v, grad, param, causal, mask = _inputs(case, getattr(torch, dtype), device, size, seed)
    reason = _skip_reason(backend, norm, q, k, v, mask, causal)
    if reason:
        return dict(row, skipped=reason)
    needs_param = NORMS[norm][2] is not None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([param.clone().requires_grad_()] if needs_param else [])
    try:
        with K.force_backend(None if backend == "dispatch" else backend):
            _poison(q, q, k, v)  # out, dq, dk, dv
            out = _kernel(norm, *leaves[:3], leaves[3] if needs_param else None, causal, mask)
            _poison(q, k, v)
            out.backward(grad)
    except Exception as err:  # a crash is a failed check, recorded with its message
        return dict(row, passed=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    wide = [x.detach().double().requires_grad_() for x in leaves]
    ref = reference(*wide[:3], NORMS[norm][0], wide[3] if needs_param else None, p=NORMS[norm][1], causal=causal,
                    mask=mask)
    ref.backward(grad.double())
    names = ["out", "dq", "dk", "dv"] + (["d" + NORMS[norm][2]] if needs_param else [])
    got = [out] + [x.grad for x in leaves]
    want = [ref] + [x.grad for x in wide]
    errors = {name: _relative(x, r) for name, x, r in zip(names, got, want)}
    finite = all(x is not None and bool(torch.isfinite(x).all()) for x in got)
    tol = TOLERANCE[dtype]
    return dict(row, errors={n: float(f"{e:.3g}") for n, e in errors.items()}, tolerance=tol, finite=finite,
                passed=finite and all(e <= tol for e in errors.values()))  # NaN compares False: a failure


def backends(device: str) -> list[str]:
    """Every backend that can run on `device`: dispatch (what users get), each forced kernel, and the decode path
    (dispatch picks it for a few query rows; forced here on every case, so it is checked at full length too)."""
    if device.startswith("cuda"):  # the compiled FlexAttention last: its compilations take the longest
        return ["dispatch", "triton", "cuda_flash", "cuda_efficient", "cuda_cudnn", "decode", "blockwise", "flex"]
    return ["dispatch", "cpu_fused", "decode", "blockwise"]


def run_suite(device: str, tiny: bool = False, dtypes=DTYPES, norms=tuple(NORMS), budget_s: float | None = None,
              backends_: list[str] | None = None, on_row=None) -> dict:
    """Every backend x dtype x norm x case on `device`; counts, the worst error per dtype, and every row.
    Past `budget_s` seconds (first-time Triton and FlexAttention compilations are the slow part) the remaining
    checks are recorded as not run, and counted apart: a suite that did not finish has not passed. Backends go
    one after another, so a budget cut falls on the last ones (FlexAttention), not on a dtype. `on_row(summary)`
    is called after each check with the summary so far."""
    size = SIZES["tiny" if tiny else "full"]
    start = time.perf_counter()
    rows = []
    chosen = backends_ or backends(device)

    def summary() -> dict:
        return summarize(rows, device, size, dtypes, norms, chosen, time.perf_counter() - start)

    for backend in chosen:
        for dtype in dtypes:
            for norm in norms:
                for case in CASES:
                    if budget_s is not None and time.perf_counter() - start > budget_s:
                        rows.append({"norm": norm, "dtype": dtype, "case": case, "backend": backend,
                                     "not_run": f"over the part's {budget_s:g} s budget"})
                    else:
                        rows.append(check(norm, dtype, case, backend, device, size))
                        if on_row is not None:
                            on_row(summary())
    return summary()


def summarize(rows, device, size, dtypes, norms, chosen, seconds) -> dict:
    not_run = sum(1 for r in rows if "not_run" in r)
    rows_run = [r for r in rows if "not_run" not in r]
    ran = [r for r in rows_run if "skipped" not in r]
    worst = {dtype: max((max(r["errors"].values()) for r in ran if r["dtype"] == dtype and "errors" in r),
                        default=None) for dtype in dtypes}
    return {"device": device, "sizes": size, "tolerance": TOLERANCE, "cases": list(CASES), "norms": list(norms),
            "backends": chosen, "passed": sum(1 for r in ran if r["passed"]),
            "failed": sum(1 for r in ran if not r["passed"]), "skipped": len(rows_run) - len(ran), "not_run": not_run,
            "worst_error": worst, "seconds": round(seconds, 1), "checks": list(rows)}
