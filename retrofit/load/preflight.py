"""What loading a model would refuse, found before it loads: a damaged source, a layer or head index past the
model's counts, an evaluation forward that cannot fit in memory.

    check_source("runs/avnorm")                                     # an unfinished run, a damaged config: one line
    check_eval_memory(["runs/avnorm"], [1024, 4096], batch_tokens=16384, device="cuda")

The library's entry points call these before anything is allocated or written (retrofit.evaluate.evaluate_models,
retrofit.diagnose.diagnose_sources; retrofit.train.recipe_fits checks a recipe with them); a command calls the same
functions only where it needs an answer before a long load.
"""

from __future__ import annotations

import os
from pathlib import Path

from .loader import check_finished
from .models import load_config
from .patched_checkpoint import is_checkpoint
from .sources import check_model_files, source_kind


def device_for_memory() -> str:
    """Where a memory check measures: the GPU when there is one, else this machine's memory."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_source(source) -> None:
    """What loading `source` would refuse, found without loading it: an unfinished run, a damaged
    config.json or safetensors file, a malformed `retrofit` section."""
    check_finished(source)
    kind = source_kind(source)
    if kind == "folder":
        check_model_files(os.path.expanduser(str(source)))
        if (Path(os.path.expanduser(str(source))) / "config.json").is_file():
            is_checkpoint(source)  # raises on a malformed retrofit section
    elif kind == "hub":
        is_checkpoint(source)


def check_selection_counts(config, selections) -> None:
    """(spec, "layers" | "heads", label) selections against the config's layer and head counts, before the weights
    load: an index past them fails in one line (the patch checks the attention modules' own count again)."""
    from ..selection import parse_selection

    counts = {"layers": getattr(config, "num_hidden_layers", None),
              "heads": getattr(config, "num_attention_heads", None)}
    for spec, kind, label in selections:
        if spec is not None and isinstance(counts[kind], int):
            parse_selection(spec, counts[kind], label)


def check_eval_memory(sources, lengths, batch_tokens: int, device=None, dtype=None) -> None:
    """Each source loads (check_source) and its longest forward (the longest length, windows batched up to
    batch_tokens) fits in memory; loaded models (not a path or Hub id) are the caller's and are skipped."""
    from ..memory import check_fits

    if not lengths:
        return
    longest = max(lengths)
    tokens = max(1, batch_tokens // longest) * longest
    for source in sources:
        if not isinstance(source, (str, Path)):
            continue
        check_source(source)
        folder = Path(os.path.expanduser(str(source)))
        if source_kind(source) == "gguf" or (folder.is_dir() and not (folder / "config.json").is_file()):
            continue  # a GGUF file, an adapter or a LoRA run: checked when it is loaded
        check_fits(load_config(source), tokens, training=False, device=device or device_for_memory(),
                   dtype_bytes=4 if dtype in (None, "auto", "float32") else 2,  # auto: at most fp32
                   what=f"{source} at length {longest:,}",
                   lower="--lengths or --batch-tokens")  # EvalSpec lengths, batch_tokens
