"""The composed backends over PyTorch's fused kernels (kernels/cuda_fused.py) and FlexAttention (kernels/flex.py).

On CPU: their composition (p-softmax as two forwards and two backwards, softmax+1's normalizer handed to the
backward, the mask as one padded bias, repeated kv heads summed back, rows that see nothing) runs over the fused
CPU kernel standing in for the CUDA one, against the float64 reference of the parity suite. On CUDA: every norm,
dtype and case on each real backend.
"""

import pytest
import torch

import retrofit.kernels as K
from retrofit.bench import parity
from retrofit.kernels import cuda_fused

CPU_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class CpuStandIn(cuda_fused.Fused):
    """The efficient kernel's contract (bias, repeated kv heads, any dtype) computed by the fused CPU kernel."""

    def __init__(self):
        super().__init__("efficient")

    def supports(self, q, k, v, mask, causal):
        return q.device.type == "cpu" and q.dtype != torch.float64

    def _forward(self, q, k, v, bias, scale, causal):
        out, lse = CPU_FUSED(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse.float()

    def _backward(self, dout, q, k, v, out, lse, bias, scale, causal):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale)


@pytest.mark.parametrize("norm", list(parity.NORMS))
@pytest.mark.parametrize("case", parity.CASES)
def test_composition_matches_the_reference_on_the_cpu_stand_in(monkeypatch, norm, case):
    monkeypatch.setitem(cuda_fused.KERNELS, "cuda_efficient", CpuStandIn())
    row = parity.check(norm, "float32", case, "cuda_efficient", "cpu", parity.SIZES["tiny"])
    assert "skipped" not in row and row["passed"], row


def test_cuda_backends_refuse_cpu_tensors():
    q = torch.randn(1, 2, 8, 16)
    for name in (*cuda_fused.KERNELS, "flex"):
        assert not K.dispatch.takes(name, q, q, q, None, True)
        with K.force_backend(name), pytest.raises(ValueError, match=name):
            K.psoftmax_attention(q, q, q, 2.0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("backend", [*cuda_fused.KERNELS, "flex"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_norm_on_each_cuda_backend(backend, dtype):
    rows = [parity.check(norm, dtype, case, backend, "cuda", parity.SIZES["full"])
            for norm in parity.NORMS for case in parity.CASES]
    failed = [r for r in rows if "skipped" not in r and not r["passed"]]
    assert not failed, failed[:3]
    refuses_fp32 = backend in ("cuda_flash", "cuda_cudnn") and dtype == "float32"  # half-precision kernels only
    assert any("skipped" not in r for r in rows) != refuses_fp32
