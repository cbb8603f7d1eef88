"""retrofit: retrofit attention normalizations onto Hugging Face causal LMs and measure length extrapolation.

    import retrofit
    report = retrofit.patch(model, "avnorm", kind="rms")
    retrofit.calibrate(model, batches)          # per-head gains from text: start near the original function
    with retrofit.patch_bypassed(model): ...   # the original model, same weights (a distillation teacher)
    retrofit.extend_rope(model, "dynamic:4")   # a patched model without a RoPE extension gets one; its norm stays
    retrofit.unpatch(model)
    model = retrofit.from_pretrained(folder)    # rebuilds the patch recorded in config.retrofit (transformers' args)
    model = retrofit.load.load(source)          # the one loader: Hub id, folder, .gguf, run, checkpoint, adapter
"""

from .calibrate import calibrate
from .errors import RetrofitError
from .load import from_pretrained
from .norms import available_norms, describe_norms
from .patch import PatchReport, is_patched, observe, patch, patch_record, unpatch
from .recovery import patch_bypassed
from .rope import extend_rope
from .version import VERSION as __version__

__all__ = [
    "PatchReport", "RetrofitError", "available_norms", "calibrate", "describe_norms", "extend_rope", "from_pretrained",
    "is_patched", "observe", "patch", "patch_bypassed", "patch_record", "unpatch", "__version__",
]
