"""retrofit as an axolotl plugin: patch, calibrate and recover from axolotl's own YAML.

    plugins:
      - retrofit.integrations.axolotl.RetrofitPlugin
    retrofit_patch: avnorm:kind=rms                # retrofit.PatchSpec.parse: NORM[:KEY=VALUE,...]
    retrofit_calibration_text: data/book.txt      # per-head gains from this text (AVNorm; psoftmax with gain)
    retrofit_calibration_tokens: 8192
    retrofit_recovery: {steps: 100, shape: cosine}  # the recovery schedule (recovery.schedule's keys)

The hooks, in axolotl's order (axolotl/integrations/base.py, BasePlugin):
    pre_model_load        retrofit.enable(): base_model may itself be a retrofit checkpoint, loaded by path
    post_model_build      patch (a base that already carries this patch keeps it), calibrate; with a LoRA adapter,
                          the patch's own parameters join lora_modules_to_save (as retrofit.peft_config does)
    add_callbacks_post_trainer  RetrofitCallback(schedule=retrofit_recovery)
    post_train            a LoRA run's adapter folder gets retrofit.json + retrofit.safetensors, so
                          retrofit.from_pretrained(output_dir) rebuilds it (a full finetune saves config.retrofit)
Nothing is imported from axolotl but its BasePlugin, and only when axolotl is installed.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from ..errors import RetrofitError, quoted
from ..load.adapters import has_patch_parameters, write_patch_files
from ..norms import calibrated_norm_hints, get_norm
from ..patch_spec import PatchSpec
from ..patching import patch, patch_record
from .auto_classes import enable
from .trainer import RetrofitCallback, schedule_section

try:  # subclassing axolotl's own base when it is installed; its hooks are all this plugin relies on
    from axolotl.integrations.base import BasePlugin
except ImportError:  # axolotl pins other transformers/peft releases than retrofit's tests: the hooks alone
    BasePlugin = object

LORA_ADAPTERS = ("lora", "qlora")


class RetrofitArgs(BaseModel):
    """The plugin's keys in axolotl's YAML, checked when axolotl validates its config."""

    retrofit_patch: str | None = Field(default=None, description="the patch, NORM[:KEY=VALUE,...] as "
                                       "retrofit.PatchSpec.parse reads it (e.g. avnorm:kind=rms, psoftmax:p=2)")
    retrofit_calibration_text: str | None = Field(default=None, description="a text file whose first "
                                                  "retrofit_calibration_tokens tokens set the per-head gains")
    retrofit_calibration_tokens: int = Field(default=8192, ge=1, le=2 ** 24)
    retrofit_recovery: dict | None = Field(default=None, description="the recovery schedule: steps, start, end, "
                                           "shape, by_layer, costs (retrofit recipes' recovery.schedule)")

    @field_validator("retrofit_patch")
    @classmethod
    def _patch(cls, value):
        if value is not None:
            PatchSpec.parse(value, what="retrofit_patch")
        return value

    @field_validator("retrofit_recovery")
    @classmethod
    def _recovery(cls, value):
        if value is not None:  # RetrofitError is a ValueError: pydantic reports it as this key's validation error
            schedule_section(value, "retrofit_recovery")
        return value


def _get(cfg, key):
    """A key of axolotl's config (a DictDefault: missing keys read as None), or of any mapping or object."""
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def _module_names(value) -> list[str]:
    """lora_modules_to_save as a list of module names: one name written as a string is that one module (a string is
    iterable: it was read as a list of its characters, issue 61); anything but names is refused in one line."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(name, str) for name in value):
        raise RetrofitError(f"lora_modules_to_save must be a module name or a list of them (e.g. [embed_tokens, "
                            f"lm_head]), got {quoted(value)}")
    return list(value)


class RetrofitPlugin(BasePlugin):
    """See the module docstring."""

    def get_input_args(self) -> str:
        return f"{__name__}.RetrofitArgs"

    def pre_model_load(self, cfg) -> None:
        enable()

    def post_model_build(self, cfg, model) -> None:
        text = _get(cfg, "retrofit_patch")
        if text is None:
            return
        spec = PatchSpec.parse(text, what="retrofit_patch")
        record = patch_record(model)
        if record is None:
            patch(model, spec)
            self._calibrate(cfg, model, spec)
        elif {k: record.get(k) for k in ("norm", "options")} != {"norm": spec.norm, "options": spec.all_options()}:
            raise RetrofitError(f"base_model {_get(cfg, 'base_model')} is already patched with {record['norm']}; "
                                f"retrofit_patch asks for {text}: load the unpatched model, or drop retrofit_patch")
        if _get(cfg, "adapter") in LORA_ADAPTERS and has_patch_parameters(model):
            cfg["lora_modules_to_save"] = sorted({*_module_names(_get(cfg, "lora_modules_to_save")), "retrofit"})

    def _calibrate(self, cfg, model, spec: PatchSpec) -> None:
        path = _get(cfg, "retrofit_calibration_text")
        if path is None:
            return
        if not get_norm(spec.norm).calibrates(spec.norm_options):
            raise RetrofitError(f"retrofit_calibration_text sets per-head gains; it needs a norm that has them: "
                                f"{calibrated_norm_hints()}")
        from ..calibration import calibrate
        from ..data.read import read_tokens
        from ..load import load_tokenizer

        tokenizer = load_tokenizer(_get(cfg, "tokenizer_config") or _get(cfg, "base_model"))
        tokens = int(_get(cfg, "retrofit_calibration_tokens") or 8192)
        length = int(_get(cfg, "sequence_len") or 512)
        ids = read_tokens(path, tokenizer, budget=tokens, special=True)[:tokens]
        rows = max(1, ids.numel() // length)
        calibrate(model, [{"input_ids": ids[:rows * length].view(rows, -1)}])

    def add_callbacks_post_trainer(self, cfg, trainer) -> list:
        recovery = _get(cfg, "retrofit_recovery")
        return [RetrofitCallback(schedule=schedule_section(recovery, "retrofit_recovery"))] if recovery else []

    def post_train(self, cfg, model) -> None:
        if _get(cfg, "retrofit_patch") is not None and hasattr(model, "get_base_model"):
            write_patch_files(model, _get(cfg, "output_dir"), _get(cfg, "base_model"))
