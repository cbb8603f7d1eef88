"""lm-evaluation-harness model type `retrofit`: downstream tasks on patched checkpoints, runs and adapters.

    pip install "retrofit-attention[eval]"     # or, in a clone: pip install -e ".[eval]"
    python -m retrofit.evaluate.harness --model retrofit \\
        --model_args pretrained=runs/avnorm,max_length=32768 --tasks hellaswag --device cpu
    python -m retrofit.evaluate.harness --model retrofit \\
        --model_args pretrained=./smollm2.gguf,norm=softmax,rope=yarn:4,max_length=32768 --tasks ...

    import retrofit.evaluate.harness          # registers the model type with lm_eval
    lm_eval.simple_evaluate(model="retrofit", model_args="pretrained=runs/avnorm", tasks=[...])

`python -m retrofit.evaluate.harness` is lm_eval's own command line with this module imported first
(lm_eval finds model types only in its registry, and has no plugin entry point for them).

Model arguments besides the harness's own (batch_size, device, ...):
  pretrained   any source `retrofit.load.load` takes: a retrofit checkpoint, a `retrofit train` run
               folder, a PEFT adapter folder, a plain HF folder or Hub id, a .gguf file, pkg:NAME/FILE
  norm, rope   patch the loaded (unpatched) model on the fly for a training-free comparison: norm=avnorm,
  nope         rope=yarn:4 (TYPE:FACTOR), nope=true; the norm's own options by name (p=2, kind=layer, ...)
  max_length   always set here: the harness otherwise truncates every request to the config's positions
               (or the tokenizer's model_max_length), silently hiding what a long-context model can do.
               Default: the learned-position limit (GPT-2), else the (RoPE-extended) max_position_embeddings.
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..errors import RetrofitError
from ..load import load, load_tokenizer
from ..norms import baseline_norm, get_norm
from ..patch_spec import PatchSpec
from ..patching import is_patched, patch
from ..positions import position_limit


def _split_options(norm: str | None, kwargs: dict) -> dict:
    """Pop the options of `norm` (its Options fields) out of the harness's keyword arguments."""
    if norm is None:
        return {}
    names = {o.name for o in get_norm(norm).option_schema()}
    return {k: kwargs.pop(k) for k in list(kwargs) if k in names}


def default_max_length(model) -> int:
    """The longest context to evaluate when the user gave none (see the module docstring)."""
    limit = position_limit(model)
    if limit is not None:
        return limit
    return int(getattr(model.config, "max_position_embeddings", None) or 2048)


@register_model("retrofit")
class RetrofitLM(HFLM):
    """HFLM over a model loaded (and optionally patched) by retrofit; everything else is the harness's own."""

    def __init__(self, pretrained: str, *, norm: str | None = None, rope: str | None = None, nope: bool = False,
                 max_length: int | None = None, tokenizer: str | None = None, dtype: str | None = None,
                 device: str | None = None, **kwargs):
        if kwargs.pop("trust_remote_code", False) not in (False, "False", "false", None):
            raise RetrofitError("trust_remote_code: retrofit never runs a model's own code; use a model whose "
                                "architecture transformers ships")
        wanted = norm is not None or rope is not None or nope
        options = _split_options(norm, kwargs)
        spec = PatchSpec(norm or baseline_norm(), options, rope=rope, nope=nope) if wanted else None
        model = load(str(pretrained), task_head=False, dtype=None if dtype in (None, "auto") else dtype)
        if spec is not None:  # checked above, before loading
            if is_patched(model):
                raise RetrofitError(f"{pretrained} is already patched ({model.config.retrofit['norm']}); "
                                    "norm=/rope= patch unpatched models only")
            patch(model, spec)
        tok = load_tokenizer(tokenizer or str(pretrained))
        if tok is None:
            raise RetrofitError(f"{pretrained} has no tokenizer: pass tokenizer=FOLDER in --model_args")
        self.retrofit_max_length = int(max_length) if max_length else default_max_length(model)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=model.to(device), tokenizer=tok, max_length=self.retrofit_max_length,
                         device=device, trust_remote_code=False, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line, with the `retrofit` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
