"""retrofit: retrofit attention normalizations onto Hugging Face causal LMs and measure length extrapolation.

    import retrofit
    report = retrofit.patch(model, "avnorm", kind="rms")
    retrofit.calibrate(model, batches)          # per-head gains from text: start near the original function
    retrofit.unpatch(model)
    model = retrofit.from_pretrained(folder)    # rebuilds the patch recorded in config.retrofit
"""

__version__ = "0.1.0"

from .errors import RetrofitError  # noqa: E402
from .norms import available_norms, describe_norms  # noqa: E402
from .patch import PatchReport, is_patched, observe, patch, patch_record, unpatch  # noqa: E402
from .calibrate import calibrate  # noqa: E402
from .models import from_pretrained, load_model  # noqa: E402

__all__ = [
    "PatchReport", "RetrofitError", "available_norms", "calibrate", "describe_norms", "from_pretrained",
    "is_patched", "load_model", "observe", "patch", "patch_record", "unpatch", "__version__",
]
