"""Facts about this GPU's fused attention ops that retrofit/kernels/cuda_fused.py and flex.py rely on."""
import torch, traceback
aten = torch.ops.aten
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
q = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16)
def ref_lse(q, k, scale):
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1).float()
    s = q.float() @ kk.transpose(-1, -2) * scale
    return torch.logsumexp(s, -1)
for name, call in [
    ("flash", lambda q, k: aten._scaled_dot_product_flash_attention(q, k, k, 0.0, False)),
    ("efficient", lambda q, k: aten._scaled_dot_product_efficient_attention(q, k, k, None, True, 0.0, False)),
    ("cudnn", lambda q, k: aten._scaled_dot_product_cudnn_attention(q, k, k, None, True, 0.0, False, False))]:
    for kk, what in ((q, "MHA"), (k, "GQA")):
        try:
            outs = call(q, kk)
            lse = outs[1]
            print(name, what, "out", tuple(outs[0].shape), "lse", tuple(lse.shape), lse.dtype, tuple(lse.stride()),
                  "aux", [type(x).__name__ + (str(tuple(x.shape)) if torch.is_tensor(x) else repr(x)) for x in outs[2:]])
            L = lse.reshape(2, 4, -1)[..., :100].float()
            print("   lse err vs ref", (L - ref_lse(q, kk, 64 ** -0.5)).abs().max().item())
        except Exception as e:
            print(name, what, "FAILED", type(e).__name__, str(e).splitlines()[0][:300])
try:
    from torch.nn.attention.flex_attention import flex_attention
    f = torch.compile(flex_attention)
    o, lse = f(q, k, k, enable_gqa=True, return_lse=True)
    print("flex lse", tuple(lse.shape), lse.dtype, "err vs ref", (lse.float() - ref_lse(q, k, 64 ** -0.5)).abs().max().item())
except Exception:
    traceback.print_exc()
