"""Loading: one dispatcher from what the user typed to a model, and saving a run's model.

    from retrofit.load import load, load_model, load_tokenizer, from_pretrained
    model = load("runs/counting")                 # any source; a counting run comes back with its head
    model = from_pretrained("runs/avnorm")        # base -> patch from config.retrofit -> patch tensors

Modules, bottom up: sources (Hub id | folder | .gguf | pkg:), models (plain transformers loading),
checkpoint (retrofit checkpoints), adapters (PEFT adapters with their patch), task_model (the counting
head), runs (run folders, recipes' models, and the dispatcher `load`).
"""

from .adapters import load_adapter, save_adapter
from .checkpoint import load_checkpoint
from .models import load_config, load_plain_model, load_tokenizer, model_from_config, training_dtype
from .runs import (
    apply_patch,
    check_finished,
    from_pretrained,
    load,
    load_base,
    load_model,
    recipe_tokenizer,
    save_model,
)
from .sources import check_model_files, check_safetensors, is_hub_id, resolve_source, source_kind
from .task_model import CountingModel, language_model

# `retrofit.load.load_run` reads as what it is at call sites that load a finished run folder.
load_run = load

__all__ = [
    "CountingModel", "apply_patch", "check_finished", "check_model_files", "check_safetensors", "from_pretrained",
    "is_hub_id", "language_model", "load", "load_adapter", "load_base", "load_checkpoint", "load_config", "load_model",
    "load_plain_model", "load_run", "load_tokenizer", "model_from_config", "recipe_tokenizer", "resolve_source",
    "save_adapter", "save_model", "source_kind", "training_dtype",
]
