"""The recipe's sections: one dataclass each, whose fields are the YAML keys (with their documentation).

    patch    the attention patch (options pass through)  data    what to train on (packing: concat | documents)
    train    the optimization (peft: LoRA)               eval    periodic evaluation
    output   where results go

`model` (what to load or build, checked against transformers' config classes) is recipe/model.py; the optional
`recovery` section (schedules, distillation) is recipe/recovery_section.py.

Wrong types and impossible values fail in `__post_init__`, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from ..errors import RetrofitError, closest, quoted
from .schema import require, setting

if TYPE_CHECKING:
    from ..patch_spec import PatchSpec

# The norms (and so torch) are imported where a method needs them, not here: `retrofit train bad.yaml` checks the
# recipe's keys before paying for torch (issue 62), and this module is imported for that check.


@dataclass
class PatchSection:
    # Keys that are no field of this section are the norm's own options (patch.p: 2, patch.kind: layer), collected
    # into `options` and validated by the norm's Options dataclass: each option is declared once, in its norm's file.
    pass_through: ClassVar[str] = "options"
    renamed: ClassVar[dict] = {"calibrate": "calibrate_tokens"}  # old key -> its name now (saved runs still load)

    norm: str | None = setting(None, "attention normalization: a norm `retrofit norms` lists (its options are the "
                                     "patch.<option> keys); null = leave the model's attention as loaded (the L1 "
                                     "baseline arm)")
    nope: bool = setting(False, "remove positional information (NoPE); required to train GPT-2 beyond its 1024 learned "
                                "positions")
    calibrate_tokens: int | None = setting(None, "tokens of training data used to calibrate AVNorm's per-head gains; "
                                                 "0 = off (unit gain); null = 8192 when norm is avnorm on a pretrained "
                                                 "model")
    rope: str | dict | None = setting(None, "extend RoPE (retrofit.rope): 'yarn:4', 'dynamic:4', 'linear:4', "
                                            "'llama3:8,low_freq_factor=1,high_freq_factor=4' or a mapping {rope_type: "
                                            "yarn, factor: 4}; with norm softmax, the training-free baseline; null = "
                                            "RoPE as loaded")
    layers: str | int | list | None = setting(None, "patch only these attention layers (0-based): '16-29', '0,3', "
                                                    "':4' (every 4th), [16, 17]; null = every layer")
    heads: str | int | list | None = setting(None, "a per-head norm (`retrofit norms` marks them): act on these "
                                                   "query heads only (same syntax); null = every head")
    gate: str | dict | None = setting(None, "output gate (retrofit.gate), each head's output times 2s*sigmoid(W x + b) "
                                            "from the layer input: head | element[:START[:INPUTS]], e.g. head (the "
                                            "identity at start: retrofits), head:0.5:12 (the AVnorm post's); null = "
                                            "none")
    options: dict = setting(factory=dict, doc="the norm's options, written flat beside `norm` (patch.p: 2); see "
                                              "`retrofit norms`; unset = the norm's default")

    def __post_init__(self):
        known = sorted({f.name for f in dataclasses.fields(self) if f.name != "options"} | _all_norm_options())
        for key in self.options:
            require(key in known, f"unknown recipe key patch.{key}{closest(key, known)}; valid keys in patch: "
                               f"{', '.join(known)}")
        self.options = {k: v for k, v in self.options.items() if v is not None}  # null = the norm's default
        if self.norm is None:
            given = list(self.options)
            require(not given and not self.nope and not self.calibrate_tokens and self.rope is None
                 and self.layers is None and self.heads is None and self.gate is None,
                 f"patch: {', '.join(given) or 'nope/calibrate_tokens/rope/gate'} given but patch.norm is null; set "
                 "patch.norm (softmax keeps attention unchanged)")
            return
        from ..norms import NORMS
        schema = {o.name: o for o in NORMS[self.norm].option_schema()} if self.norm in NORMS else {}
        for key, value in self.options.items():  # typed as a checkpoint's record is (Norm.option_schema)
            if key in schema and not schema[key].accepts(value):
                raise RetrofitError(f"patch.{key} must be {schema[key].expects}, got {quoted(value)}")
        self.options = self.spec().options  # every rule of the patch is checked there; options typed (p: 2 -> 2.0)
        require(self.calibrate_tokens is None or self.calibrate_tokens >= 0,
             f"patch.calibrate_tokens must be >= 0 tokens, got {self.calibrate_tokens}")
        by_default = [name for name, cls in sorted(NORMS.items()) if cls.calibrated_by_default]
        require(not self.calibrate_tokens or self.norm in by_default,
             f"patch.calibrate_tokens sets the per-head gains of {', '.join(by_default)}, but patch.norm is "
             f"{self.norm!r}; set patch.calibrate_tokens: 0")

    def spec(self) -> PatchSpec | None:
        """The patch as a PatchSpec (None: patch.norm null, the model as loaded)."""
        from ..patch_spec import RECIPE, PatchSpec
        if self.norm is None:
            return None
        return PatchSpec(self.norm, self.options, nope=self.nope, rope=self.rope, layers=self.layers,
                         heads=self.heads, gate=self.gate, names=RECIPE)

    def tokens_to_calibrate(self, pretrained: bool) -> int:
        """patch.calibrate_tokens, or its default: 8192 for a norm calibrated by default (AVNorm: Norm.
        calibrated_by_default) on a pretrained model unless the options given set what it calibrates (AVNorm's
        gain: Norm.calibration_given), else 0."""
        if self.calibrate_tokens is not None:
            return self.calibrate_tokens
        from ..norms import NORMS
        cls = NORMS[self.norm] if self.norm is not None else None
        default = cls is not None and cls.calibrated_by_default and not cls.calibration_given(self.options)
        return 8192 if default and pretrained else 0

    @staticmethod
    def option_documentation(prefix: str) -> list[tuple[str, str, str]]:
        """(patch.<option>, default, 'norm: doc') for every option of every registered norm (its option schema)."""
        from ..norms import NORMS
        return [(f"{prefix}{o.name}", repr(o.default), f"{name}: {o.doc}")
                for name, cls in sorted(NORMS.items()) for o in cls.option_schema()]


def _all_norm_options() -> set[str]:
    from ..norms import NORMS
    return {o.name for cls in NORMS.values() for o in cls.option_schema()}


@dataclass
class CountingOptions:
    alphabet: int = setting(8, "symbols 0..alphabet-1; smaller = larger counts per length "
                               "(the model's vocab must be >= this)")
    first_token: bool = setting(False, "add a learned 2-row table to the token embeddings, row 0 at the first token, "
                                       "row 1 at every other (the L2 post's only position signal); with patch.nope: "
                                       "true the model sees no other position")

    def __post_init__(self):
        require(self.alphabet >= 2, f"data.counting.alphabet must be >= 2, got {self.alphabet}")


@dataclass
class PasskeyOptions:
    digits: int = setting(5, "digits in the pass key")
    depth: float | None = setting(None, "where the key sits, 0 = start .. 1 = end; null = uniform random per example")

    def __post_init__(self):
        require(1 <= self.digits <= 20, f"data.passkey.digits must be in 1..20, got {self.digits}")
        require(self.depth is None or 0 <= self.depth <= 1, f"data.passkey.depth must be in [0, 1], got {self.depth}")


TASKS = ("lm", "counting", "passkey")


@dataclass
class DataSection:
    task: Literal["lm", "counting", "passkey"] = setting("lm", "lm: next-token prediction on text; counting: "
                                                               "running count of a target symbol (regression head, "
                                                               "L1); passkey: retrieve a number hidden in filler text")
    seq_len: int = setting(1024, "training length in tokens (the longest, when train.init_len stages it); longer = "
                                 "slower, and what 'trained length' means for extrapolation")
    dataset: str | None = setting(None, "lm: Hub dataset name, e.g. HuggingFaceFW/fineweb-edu; with data.files "
                                        "too, what trains when none of the files is here")
    config: str | None = setting(None, "lm: Hub dataset config, e.g. sample-10BT")
    split: str = setting("train", "lm: Hub split to train on")
    text_field: str = setting("text", "lm: column holding the text")
    streaming: bool = setting(False, "lm: stream the Hub dataset instead of downloading it (needed for FineWeb-Edu "
                                     "size)")
    files: list[str] | None = setting(None, "lm: local .txt/.jsonl/.parquet files or globs; with data.dataset too, "
                                            "the offline path: they train when all are here, the Hub dataset when "
                                            "none is, and some but not all is an error")
    val_files: list[str] | None = setting(None, "lm: local validation files (given data.dataset and data.files "
                                                "both: when the files train); null = hold out the first val_blocks "
                                                "blocks")
    val_split: str | None = setting(None, "lm: Hub split for validation (given data.dataset and data.files both: when "
                                          "the Hub trains); null = hold out the first val_blocks blocks")
    val_blocks: int = setting(16, "lm: validation blocks (of the longest eval length): the first ones of val_files/"
                                  "val_split, or else held out from the start of the training data (deterministic)")
    max_docs: int | None = setting(None, "lm, not streaming: read at most this many documents (quick runs); null = all")
    shuffle: bool = setting(True, "lm, not streaming: reshuffle training blocks every epoch (seeded)")
    packing: Literal["concat", "documents"] = setting(
        "concat", "lm: concat = documents joined with EOS and cut into seq_len blocks (attention and "
                  "positions run across documents); documents = whole documents packed into each row (best fit, the "
                  "rest padded and unscored), positions restarting at every document and attention confined to it "
                  "for every norm; a document longer than seq_len is split at seq_len; streamed, they are packed 8 "
                  "rows' worth at a time. Validation stays concat")
    cache_dir: str | None = setting(None, "datasets cache folder; null = the datasets default")
    counting: CountingOptions = setting(factory=CountingOptions, doc="counting task options")
    passkey: PasskeyOptions = setting(factory=PasskeyOptions, doc="passkey task options")

    def __post_init__(self):
        require(self.seq_len >= 2, f"data.seq_len must be >= 2, got {self.seq_len}")
        require(self.val_blocks >= 1,
                f"data.val_blocks must be >= 1 (every evaluation reads them), got {self.val_blocks}")
        require(self.max_docs is None or self.max_docs > 0, f"data.max_docs must be > 0, got {self.max_docs}")
        if self.task == "lm":
            require(self.files != [], "data.files is an empty list; list files, or remove the key")
            require(self.dataset is not None or self.files is not None,
                  "data: the lm task needs data.dataset (Hub) or data.files (local), or both (the files when here)")
            require(self.val_files is None or self.val_split is None or None not in (self.dataset, self.files),
                  "data: set val_files or val_split, not both (both only beside data.dataset and data.files)")
        else:
            require(self.dataset is None and self.files is None,
                  f"data: the {self.task} task is generated; remove data.dataset/data.files")
            require(self.packing == "concat", f"data.packing packs text documents; the {self.task} task is generated: "
                                           "remove data.packing")


@dataclass
class PeftSection:
    r: int = setting(8, "LoRA rank; higher = more capacity and memory")
    alpha: float = setting(16.0, "LoRA scaling numerator (scale = alpha / r)")
    dropout: float = setting(0.0, "dropout on the LoRA input")
    target_modules: list[str] | None = setting(None, "module names to adapt; null = PEFT's default for the model type")
    train_patch: bool = setting(True, "also train the patch's own parameters (the `retrofit` child of each attention "
                                      "module, via modules_to_save)")
    save: Literal["merged", "adapter", "both"] = setting("both", "merged: a plain retrofit checkpoint in the run "
                                                                "folder; adapter: run/adapter only (small); both")

    def __post_init__(self):
        require(self.r >= 1, f"train.peft.r must be >= 1, got {self.r}")
        require(0 <= self.dropout < 1, f"train.peft.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class TrainSection:
    steps: int = setting(1000, "optimizer steps")
    seed: int = setting(0, "seeds model init, data order and dropout")
    lr: float = setting(3e-4, "peak learning rate (AdamW)")
    min_lr_ratio: float = setting(0.1, "cosine decays to lr * min_lr_ratio")
    warmup_steps: int = setting(100, "linear warmup from 0 to lr")
    weight_decay: float = setting(0.1, "decoupled weight decay on matrices; "
                                       "never on norms, biases, embeddings, patch gains")
    betas: list[float] = setting(factory=lambda: [0.9, 0.95], doc="AdamW betas")
    adam_eps: float = setting(1e-8, "AdamW epsilon")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = off")
    batch_size: int = setting(8, "global sequences of data.seq_len per optimizer step (all processes together); "
                                 "tokens/step = batch_size * seq_len, kept constant while staging")
    micro_batch_size: int = setting(8, "sequences per process per forward; smaller = less memory, more accumulation "
                                       "(accumulation = batch_size / (micro_batch_size * data-parallel processes))")
    init_len: int | None = setting(None, "staged length (L2-softmax post): start at init_len, double every "
                                         "double_every steps up to data.seq_len; null = always seq_len")
    double_every: int = setting(0, "steps between length doublings when init_len is set")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting("auto", "auto = bf16 on a GPU that has it, else fp32")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward: ~30% slower, much less memory")
    activation_offload: bool = setting(False, "saved activations wait in CPU RAM (save_on_cpu): less GPU memory, "
                                              "slower")
    loss_chunk_tokens: int = setting(1024, "positions x rows whose logits the loss holds at once (recomputed in "
                                           "backward); 0 = all (B, T, vocab) logits: more memory, no recompute")
    compile: bool = setting(False, "torch.compile the model (inductor); slow first steps, recompiles per staged length")
    cpu: bool = setting(False, "run on CPU even when a GPU is present")
    sequence_parallel: int = setting(1, "N processes share each row (Ulysses: each holds T/N tokens, attention sees "
                                        "the whole row for H/N heads); groups of N are data parallel; 1 = off")
    fsdp: bool = setting(False, "FSDP2 over every process (retrofit.train.fsdp.shard_model): weights, gradients and "
                                "AdamW state sharded instead of DDP's copies, checkpoints per process; LoRA saves "
                                "the adapter")
    deepspeed: str | None = setting(None, "a DeepSpeed JSON config (ZeRO stage ...): DeepSpeed under torchrun or the "
                                          "deepspeed launcher; its \"auto\"s come from this section, conflicts are "
                                          "refused; null = none (accelerate launch --config_file may still ask)")
    log_every: int = setting(10, "steps between log lines (loss is averaged over them)")
    progress: bool = setting(True, "show a progress bar (loss, tokens/s, ETA)")
    cpu_release_memory: bool = setting(True, "CPU: freed tensors of 1 MiB or more go back to the OS at once (glibc's "
                                             "mmap threshold; retrofit.memory): a lower peak at long lengths, but "
                                             "~1.8x slower steps for a small model's many small tensors (measured); "
                                             "false for small-model experiments. Results are the same either way")
    peft: PeftSection | None = setting(None, "LoRA finetune instead of full; null = train all weights")

    def __post_init__(self):
        require(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        require(0 <= self.seed < 2**32,
                f"train.seed must be in 0..2**32-1 (what numpy and torch take), got {self.seed}")
        require(math.isfinite(self.adam_eps) and self.adam_eps > 0,
             f"train.adam_eps must be > 0 and finite (AdamW divides by sqrt(v) + eps), got {self.adam_eps}")
        require(math.isfinite(self.lr) and self.lr >= 0, f"train.lr must be >= 0 and finite, got {self.lr}")
        require(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        require(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
              f"train.betas must be two numbers in [0, 1), got {quoted(self.betas)}")
        require(self.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        require(self.batch_size >= 1 and self.micro_batch_size >= 1,
                "train.batch_size and micro_batch_size must be >= 1")
        require(self.batch_size % self.micro_batch_size == 0,
              f"train.batch_size {self.batch_size} must be a multiple of micro_batch_size {self.micro_batch_size}")
        require(self.log_every >= 1, f"train.log_every must be >= 1, got {self.log_every}")
        require(self.sequence_parallel >= 1, f"train.sequence_parallel must be >= 1 (1 = off), got "
                                          f"{self.sequence_parallel}")
        require(self.loss_chunk_tokens >= 0, f"train.loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        if self.init_len is not None:
            require(self.init_len >= 2 and self.double_every >= 1,
                  "train: staged length needs init_len >= 2 and double_every >= 1")


@dataclass
class EvalSection:
    every: int = setting(0, "evaluate every N steps; 0 = only at the end")
    at_steps: list[int] = setting(factory=list, doc="also evaluate after exactly these steps (0 = before training), "
                                                     "e.g. a finetune schedule [0, 10, 20, 50]")
    batches: int = setting(4, "validation batches per evaluation")
    batch_size: int = setting(8, "sequences per validation batch")
    lengths: list[int] | None = setting(None, "evaluation lengths (counting/passkey: generated at each; lm: the first "
                                             "L tokens of held-out blocks); null = [data.seq_len]")

    def __post_init__(self):
        require(self.every >= 0, f"eval.every must be >= 0, got {self.every}")
        require(all(s >= 0 for s in self.at_steps), f"eval.at_steps must be >= 0, got {quoted(self.at_steps)}")
        require(self.batches >= 1 and self.batch_size >= 1, "eval.batches and eval.batch_size must be >= 1")
        require(self.lengths is None or (self.lengths and all(n >= 2 for n in self.lengths)),
              f"eval.lengths must be a non-empty list of lengths >= 2, got {quoted(self.lengths)}")


# accelerate's trackers (accelerate.tracking.LOGGER_TYPE_TO_CLASS; tests/recipe checks the two agree) -> the package
# that provides each: a tracker whose package is missing is refused before the run starts (accelerate drops it
# without a word).
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "comet_ml": "comet-ml",
            "mlflow": "mlflow", "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab"}


@dataclass
class OutputSection:
    dir: str | None = setting(None, "run folder (checkpoints, log.jsonl, final model); null = runs/<recipe name>")
    save_every: int = setting(0, "write a resumable checkpoint every N steps and after the last (a raised "
                                 "train.steps extends the run from it); 0 = never (the final model is always saved)")
    keep: int = setting(2, "checkpoints kept (oldest deleted)")
    trackers: list[str] = setting(factory=list, doc="besides log.jsonl (always), any of accelerate's: tensorboard, "
                                                    "wandb, trackio, comet_ml, mlflow, aim, clearml, dvclive, swanlab")
    project: str = setting("retrofit", "tracker project name")

    def __post_init__(self):
        require(self.save_every >= 0, f"output.save_every must be >= 0, got {self.save_every}")
        require(self.keep >= 1, f"output.keep must be >= 1, got {self.keep}")
        for t in self.trackers:
            require(t in TRACKERS, f"output.trackers: unknown tracker {t!r}{closest(t, TRACKERS)}; "
                                 f"choose from {', '.join(TRACKERS)} (jsonl is always on)")
