"""What `evaluate_models` does with its sources, as one checked dataclass (the CLI and the experiment fill it).

    spec = EvalSpec(lengths="256,512,...,65536", data=["persuasion.txt"], train_len=1024, rope="yarn:4")
    results = evaluate_models(["runs/base", "runs/avnorm"], spec)

Wrong values fail in `__post_init__` with a one-line RetrofitError, before any model loads: an unknown task, a
bad norm, option or rope, a malformed variant. The result's schema is docs/results-schema.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RetrofitError
from ..lengths import parse_lengths
from ..norms import baseline_norm
from ..patch_spec import EVAL, PatchSpec, parse_flat
from ..recipe.schema import setting
from .ruler import ruler_options
from .vllm_tasks import check_engine

TASKS = ("lm", "passkey", "counting", "niah", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


@dataclass
class EvalSpec:
    """The settings of one evaluation: every source at every length, for each task (and each variant)."""

    lengths: list[int] | str = setting(doc="context lengths: [256, 512] or '256,512,...,65536' (a doubling)")
    data: list[str] | str | None = setting(None, "lm data: .json token files, or text files tokenized by `tokenizer` "
                                                 "(else each model's own)")
    tokens: list | None = field(default=None, repr=False, metadata={
        "doc": "lm data as token ids instead of `data`: one document (a list of ints) or a list of documents"})
    tasks: list[str] | None = setting(None, "some of TASKS (lm, passkey, counting, the RULER tasks niah, ..., fwe); "
                                            "None: counting for counting runs, else lm")
    names: list[str] | None = setting(None, "one name per source, in order (default: each source's folder or file)")
    reference: str | list[str] | None = setting(None, "the model(s) every other is compared with, window by window "
                                                      "(paired differences with intervals): a name, 'a,b' or a list; "
                                                      "None: the first model")
    train_len: int | None = setting(None, "the training length, marked in tables and plots")
    max_tokens: int | None = setting(None, "cap on scored tokens per length and model (None: every window)")
    max_windows: int | None = setting(None, "cap on windows per length and model, dealt across the documents "
                                            "(None: every window; with max_tokens the smaller cap wins)")
    tokenizer: Any = setting(None, "tokenizer folder, model or object for every model (None: each model's own)")
    batch_tokens: int = setting(16384, "tokens per forward (windows batched up to this)")
    chunk_tokens: int = setting(1024, "positions per head/loss chunk")
    dtype: str | None = setting(None, "float32, bfloat16, float16; None or auto: each model in the dtype it was "
                                      "saved in")
    device: str = setting("cpu", "where the models run")
    passkey: dict | None = setting(None, "keyword arguments of evaluate_passkey (depths, trials, ...)")
    counting: dict | None = setting(None, "keyword arguments of evaluate_counting (sequences, alphabet, ...)")
    ruler: dict | None = setting(None, "RULER task options: samples (per length and depth), depths, needle "
                                       "(word, number, uuid), seed; see retrofit/evaluate/ruler.py")
    progress: bool = setting(True, "progress bars")
    patch: dict | str | None = setting(None, "{norm: NAME, **options} or 'NAME:KEY=VALUE,...' (PatchSpec.parse): "
                                             "patch each unpatched model before evaluating it; a model already patched "
                                             "is evaluated as it is if it carries that same patch, else refused")
    rope: str | dict | None = setting(None, "'yarn:4' or a mapping (retrofit.rope): extend each model's RoPE first "
                                            "(alone: softmax attention, i.e. attention unchanged)")
    engine: str = setting("transformers", "transformers | vllm: vLLM (retrofit's plugin, its own environment: "
                                          "docs/serving.md) answers the generation tasks of saved checkpoints")
    variants: list[dict] | None = setting(None, "[{name, patch, rope, calibrate}, ...]: every source once per variant, "
                                                "side by side; names become SOURCE+VARIANT with several sources")
    # (variant name or None, the evaluation patch or None) per variant: what __post_init__ checked
    patches: list[tuple] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.lengths = parse_lengths(self.lengths) if isinstance(self.lengths, str) else sorted(set(self.lengths))
        self.data = [self.data] if isinstance(self.data, (str, Path)) else list(self.data or [])
        unknown = set(self.tasks or ()) - set(TASKS)
        if unknown:
            raise RetrofitError(f"unknown tasks {sorted(unknown)}: choose from {', '.join(TASKS)} "
                                "(retrofit eval --list-tasks says what each is)")
        if set(self.tasks or ()) & set(TASKS[3:]) or self.ruler is not None:
            self.ruler = ruler_options(self.ruler)  # a depth outside [0, 1] fails before any model loads
        if self.variants and (self.patch is not None or self.rope is not None):
            raise RetrofitError("give either variants or one patch/rope for every model, not both")
        # a bad norm, option or rope fails before any model loads
        self.patches = [(v["name"], _eval_patch(v.get("patch"), v.get("rope"), v.get("calibrate")))
                        for v in check_variants(self.variants)] if self.variants \
            else [(None, _eval_patch(self.patch, self.rope))]
        check_engine(self.engine, self.tasks, TASKS[3:], any(p is not None for _, p in self.patches))


def check_variants(variants) -> list[dict]:
    """Variants as `retrofit eval --variants FILE` reads them: a list of {name, patch, rope}, names unique.
    patch: {"norm": NAME, **options} (or null: the model's own attention); rope: 'yarn:4' or a mapping."""
    if not isinstance(variants, list) or not variants:
        raise RetrofitError("variants must be a non-empty list of {name, patch, rope} mappings")
    seen = set()
    for i, v in enumerate(variants):
        if not isinstance(v, dict) or not isinstance(v.get("name"), str) or not v["name"]:
            raise RetrofitError(f"variant {i + 1} needs a name, e.g. {{name: yarn4, rope: 'yarn:4'}}; got {v!r}")
        unknown = set(v) - {"name", "patch", "rope", "calibrate"}
        if unknown:
            raise RetrofitError(f"variant {v['name']!r} has unknown keys {sorted(unknown)}; use name, patch, rope, "
                                "calibrate")
        cal = v.get("calibrate")
        if cal is not None and not (isinstance(cal, dict) and isinstance(cal.get("data"), str)
                                    and isinstance(cal.get("tokens", 8192), int) and cal.get("tokens", 8192) > 0
                                    and Path(cal["data"]).is_file()):
            raise RetrofitError(f"variant {v['name']!r}: calibrate must be {{data: TEXT_FILE, tokens: N > 0}} with an "
                                f"existing file (AVNorm gains from text that is not the evaluation text); got {cal!r}")
        if v["name"] in seen:
            raise RetrofitError(f"two variants are named {v['name']!r}: give each its own name")
        if v.get("patch") is not None and not isinstance(v["patch"], dict):
            raise RetrofitError(f"variant {v['name']!r}: patch must be a mapping like {{norm: avnorm, kind: rms}}")
        seen.add(v["name"])
    return variants


def _eval_patch(patch, rope, calibration=None) -> dict | None:
    """{"norm", "options", "rope"[, "layers", "heads", "nope", "gate", "calibrate"]} to apply at evaluation (None:
    nothing),
    checked (a PatchSpec) without loading a model. patch: a mapping {norm, **options} or a --patch string.
    norm None = --rope alone: softmax on an unpatched model, any norm on a patched one."""
    if patch is None and rope is None:
        return None
    flat = parse_flat(patch) if isinstance(patch, str) else dict(patch or {})
    if patch is not None and not flat.get("norm"):
        raise RetrofitError("the evaluation patch needs a norm, e.g. --patch avnorm:kind=rms (see `retrofit norms`)")
    if rope is not None:
        if flat.get("rope") is not None:
            raise RetrofitError("the evaluation patch names a rope and --rope gives another: give it once")
        flat["rope"] = rope
    spec = PatchSpec.from_flat({**flat, "norm": flat.get("norm") or baseline_norm()}, EVAL)
    wanted = {"norm": flat.get("norm"), "options": spec.all_options() if flat.get("norm") else {}, "rope": spec.rope}
    extra = {"layers": spec.layers, "heads": spec.heads, "nope": True if spec.nope else None, "gate": spec.gate,
             "calibrate": calibration or None}
    return {**wanted, **{k: v for k, v in extra.items() if v is not None}}
