"""Loading: one loader from what the user typed to a model, and one way to save a model.

    from retrofit.load import load, load_tokenizer
    model = load("runs/counting")                 # any source; a counting run comes back with its head
    model = load("./smollm2.gguf", dtype="float32", attn_implementation="eager")   # transformers' arguments
    tokenizer = load_tokenizer("./smollm2.gguf")  # None when the source ships none
    model = retrofit.from_pretrained("runs/avnorm")   # `load`'s transformers-shaped face: patched models only

`load` (loader.py) is the one loader: it decides what a source is (run folder, adapter, retrofit checkpoint,
plain model) and forwards transformers' loading arguments; everything else here is its helpers.
Modules, bottom up: sources (Hub id | folder | .gguf | pkg:), models (plain transformers loading),
patched_checkpoint (retrofit checkpoints), adapters (PEFT adapters with their patch), task_model (the counting
head), save (`save_model`: the one way retrofit saves a model, atomically), from_recipe (what a recipe does to a
model: apply_patch, zero_init, its tokenizer), loader (run folders, a recipe's base, `load` and `from_pretrained`).
"""

from .adapters import load_adapter, save_adapter
from .from_recipe import apply_patch, recipe_tokenizer
from .loader import check_finished, from_pretrained, load, load_base
from .models import load_config, load_tokenizer, model_from_config, training_dtype
from .save import save_model
from .sources import check_model_files, check_safetensors, is_hub_id, resolve_source, source_kind
from .task_model import CountingModel, language_model

__all__ = [
    "CountingModel", "apply_patch", "check_finished", "check_model_files", "check_safetensors", "from_pretrained",
    "is_hub_id", "language_model", "load", "load_adapter", "load_base", "load_config", "load_tokenizer",
    "model_from_config", "recipe_tokenizer", "resolve_source", "save_adapter", "save_model", "source_kind",
    "training_dtype",
]
