"""`import retrofit.auto`: the same switch as `retrofit.enable()`, for places where an import is easier than a call
(a `python -c` line, a sitecustomize, a training script's first line). After it, transformers' Auto classes,
pipeline, PEFT's AutoPeftModelForCausalLM and lm-eval's `hf` model load retrofit checkpoints by path, exactly as
retrofit.from_pretrained does (retrofit/integrations/auto_classes.py); `retrofit.disable()` undoes it."""

from .integrations.auto_classes import enable

enable()
