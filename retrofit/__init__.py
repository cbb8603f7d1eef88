"""retrofit: retrofit attention normalizations onto Hugging Face causal LMs and measure length extrapolation.

    import retrofit
    report = retrofit.patch(model, "avnorm", kind="rms")
    retrofit.patch(model, retrofit.PatchSpec.parse("avnorm:kind=rms,layers=16-29"))   # the same patch, as one value
    retrofit.calibrate(model, batches)          # per-head gains from text: start near the original function
    with retrofit.patch_bypassed(model): ...   # the original model, same weights (a distillation teacher)
    retrofit.extend_rope(model, "dynamic:4")   # a patched model without a RoPE extension gets one; its norm stays
    retrofit.unpatch(model)
    model = retrofit.from_pretrained(folder)    # rebuilds the patch recorded in config.retrofit (transformers' args)
    model = retrofit.load.load(source)          # the one loader: Hub id, folder, .gguf, run, checkpoint, adapter
    retrofit.info("runs/x")                     # what a folder or model is: base, norm, options, rope, trained
    retrofit.enable()                           # transformers' AutoModelForCausalLM, pipeline, PEFT load by path too

The distribution is `retrofit-attention` on PyPI (`pip install retrofit-attention`); the import and the command
are `retrofit`. The names below are imported on first use (PEP 562), so `import retrofit` and `retrofit --help`
do not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import notices
from .version import DISTRIBUTION
from .version import VERSION as __version__

# before anything can import DeepSpeed: its "Setting accelerator to CPU" at every save on a CPU machine is dropped
# for the Python API as for the CLI (issue 62); standard-library logging only, so the import stays fast
notices.quiet_deepspeed_cpu_notice()

# public name -> the module that defines it
_PUBLIC = {
    "PatchReport": "patching", "is_patched": "patching", "patch": "patching", "patch_record": "patching",
    "unpatch": "patching", "observe": "observer", "calibrate": "calibration", "RetrofitError": "errors",
    "from_pretrained": "load", "available_norms": "norms", "describe_norms": "norms", "patch_bypassed": "recovery",
    "extend_rope": "patching", "info": "load.info", "peft_config": "load.adapters", "PatchSpec": "patch_spec",
    "enable": "integrations.auto_classes", "disable": "integrations.auto_classes",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from .calibration import calibrate
    from .errors import RetrofitError
    from .integrations.auto_classes import disable, enable
    from .load import from_pretrained
    from .load.adapters import peft_config
    from .load.info import info
    from .norms import available_norms, describe_norms
    from .observer import observe
    from .patch_spec import PatchSpec
    from .patching import PatchReport, extend_rope, is_patched, patch, patch_record, unpatch
    from .recovery import patch_bypassed


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    try:  # `retrofit.load.load(...)` after a bare `import retrofit`: the subpackage, imported on first use
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = [
    "DISTRIBUTION", "PatchReport", "PatchSpec", "RetrofitError", "available_norms", "calibrate", "describe_norms",
    "disable", "enable", "extend_rope", "from_pretrained", "info", "is_patched", "observe", "patch", "patch_bypassed",
    "patch_record", "peft_config", "unpatch", "__version__",
]
