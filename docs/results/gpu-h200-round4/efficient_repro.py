"""Standalone repro (torch only, no retrofit): PyTorch's memory-efficient attention backward handed an `out` whose
memory layout is (B, H, T, D) instead of the (B, T, H, D) its forward returns.

    python3 efficient_repro.py                   # every variant at every size, each in a fresh process
    python3 efficient_repro.py VARIANT B T       # one variant (what the parent runs)

Variants, each fwd + bwd in bf16, H = 16, D = 64, causal, against SDPA's own autograd with the efficient kernel:
  sdpa         F.scaled_dot_product_attention under sdpa_kernel(EFFICIENT_ATTENTION): PyTorch's own path
  aten-own     aten._scaled_dot_product_efficient_attention, then its _backward with the forward's own `out`
  aten-bhtd    the same, `out` made contiguous as (B, H, T, D): what retrofit <= 25e7ae4 handed it
  aten-bthd    the same, `out` copied back to the (B, T, H, D) layout: what retrofit hands it now
A variant prints one JSON line: the largest difference of dq, dk, dv from the `sdpa` variant, or the error.
A sticky CUDA error (illegal memory access) ends its process, so each variant runs in its own.
"""

import json
import subprocess
import sys

SIZES = [(2, 512), (32, 4096), (8, 16384)]  # (B, T): a small one, then the two that crashed on the H100
VARIANTS = ["sdpa", "aten-own", "aten-bhtd", "aten-bthd"]


def grads(variant, B, T):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    aten = torch.ops.aten
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, 16, T, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    if variant == "sdpa":
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
        return [x.grad for x in leaves]
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    if variant == "aten-bhtd":
        out = out.contiguous()
    elif variant == "aten-bthd":
        out = out.contiguous().transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)
    return [dq, dk, dv]


def child(variant, B, T):
    import torch

    row = {"variant": variant, "B": B, "T": T}
    try:
        got = grads(variant, B, T)
        torch.cuda.synchronize()
        want = grads("sdpa", B, T) if variant != "sdpa" else got
        torch.cuda.synchronize()
        row["max_abs_diff_vs_sdpa"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
        row["finite"] = all(bool(torch.isfinite(x).all()) for x in got)
    except Exception as err:  # RuntimeError: CUDA error: an illegal memory access was encountered
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    print(json.dumps(row), flush=True)


def main():
    if len(sys.argv) == 4:
        return child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    import torch

    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "gpu": torch.cuda.get_device_name(0)}), flush=True)
    for B, T in SIZES:
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, __file__, variant, str(B), str(T)], capture_output=True,
                                  text=True, timeout=120)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            tail = (done.stderr.strip().splitlines() or [""])[-1][:160]
            print(lines[-1] if lines else json.dumps({"variant": variant, "B": B, "T": T,
                                                      "error": f"exit {done.returncode}: {tail}"}), flush=True)


if __name__ == "__main__":
    main()
