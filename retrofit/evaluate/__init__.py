"""Length extrapolation: loss by context length and by position, passkey retrieval, counting.

    retrofit eval runs/base runs/avnorm --data persuasion.txt --lengths 256,512,...,65536 \
        --train-len 1024 --max-tokens 65536 --out eval/

    results = evaluate_models(["runs/base", "runs/avnorm"], EvalSpec(data=["persuasion.txt"], lengths="256,...,65536"))
    results = evaluate_models(["HuggingFaceTB/SmolLM2-135M"],
                              EvalSpec(data=["persuasion.txt"], lengths="512,...,32768", rope="yarn:4"))
                              # patched on the fly: softmax + YaRN, the training-free baseline

Modules: windows (data, windows, position buckets) <- scoring (chunked losses, passkey, counting)
<- spec (EvalSpec: the settings, checked before any model loads), intervals + compare (95% intervals, paired
differences to a reference model)
<- driver (evaluate_models: every model at every length -> the results dict, docs/results-schema.md)
<- report (tables, CSV, plots, report.md) <- folder (evaluate_into, merge_into: what `retrofit eval` does, the
report in a folder). The CLI is retrofit/commands/eval.py; this file is the public API.
"""

from __future__ import annotations

from ..lengths import parse_lengths
from .compare import paired_comparisons
from .driver import evaluate_models, evaluation_names
from .scoring import (
    LOGIT_TRANSFORMS,
    check_head,
    check_lengths,
    evaluate_counting,
    evaluate_lengths,
    evaluate_passkey,
    fresh_dynamic_rope,
    head_logits,
    original_positions,
    token_losses,
)
from .spec import EvalSpec, check_variants
from .windows import cut_windows, position_buckets, read_token_file, tokenize_files, tokenizer_fingerprint

__all__ = [
    "LOGIT_TRANSFORMS", "check_head", "check_lengths", "cut_windows", "evaluate_counting", "evaluate_lengths",
    "EvalSpec", "check_variants", "evaluate_models", "evaluation_names", "paired_comparisons", "evaluate_passkey",
    "fresh_dynamic_rope",
    "head_logits",
    "original_positions",
    "parse_lengths", "position_buckets", "read_token_file",
    "token_losses", "tokenize_files", "tokenizer_fingerprint",
]
