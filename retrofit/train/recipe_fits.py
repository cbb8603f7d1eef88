"""What a recipe asks that cannot run, found before the model is built: `train()` and `run_experiment()` call
`check_recipe_fits` first, so a Python caller gets the same one-line refusal as `retrofit train`, before a run
folder exists or a byte of the model is allocated.

    check_recipe_fits(load_recipe("recipes/demo.yaml"))                  # raises RetrofitError, or returns
    check_recipe_fits(recipe, model=model, data=data)   # a model and data passed in code, as train() takes them

The engine checks that need the launched accelerator (FSDP, DeepSpeed, sequence parallelism) are in fsdp.py,
zero.py and sequence_parallel.py; they run once the accelerator exists, still before the model is built.
"""

from __future__ import annotations

from ..data.text import check_files
from ..load import language_model, load_config
from ..load.preflight import check_selection_counts, check_source, device_for_memory
from ..memory import check_fits


def recipe_config(recipe):
    """The transformers config the recipe's model will have, read without loading weights (model.source's
    config.json, or model.config built); None when it cannot be told here (building the model reports why)."""
    m = recipe.model
    if m.source is not None:
        check_source(m.source)
        return load_config(m.source, m.revision)
    if m.config and "model_type" in m.config:
        from transformers import AutoConfig
        cfg = dict(m.config)
        try:
            return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        except (ValueError, TypeError):
            return None  # building the model reports a bad config in its own words
    return None


def check_recipe_fits(recipe, *, model=None, data=None) -> None:
    """Before the model is built: the data files (retrofit.data.text.check_files), the model's source, the patches'
    layer and head selections (the experiment arms' too), and memory: training (data.seq_len x
    train.micro_batch_size) and its evaluation (the longest eval length x eval.batch_size) must fit
    (retrofit.memory.check_fits). `model`, `data`: passed in code as train() takes them, so model.source and
    data.files are not read (the model's own config is checked)."""
    if data is None:
        check_files(recipe.data)  # before any model is loaded: a bad file list fails in a second
    config = getattr(language_model(model), "config", None) if model is not None else recipe_config(recipe)
    if config is None:
        return
    patches = [(recipe.patch, "patch")]
    exp = recipe.section("experiment")
    patches += [(arm.patch, f"experiment arm {arm.name}: patch") for arm in (exp.arms if exp is not None else [])]
    check_selection_counts(config, [(getattr(section, key), key, f"{where}.{key}")
                                    for section, where in patches for key in ("layers", "heads")])
    device = "cpu" if recipe.train.cpu else device_for_memory()  # train.cpu: on this machine's memory, GPU or not
    m, train = recipe.model, recipe.train
    # half-precision weights or mixed precision ("auto" may pick bf16) keep 2-byte activations: the lower bound
    size = 4 if m.dtype in ("auto", "float32") and train.precision == "fp32" else 2  # auto trains in fp32
    shared = train.sequence_parallel  # each of N processes holds seq_len / N tokens of a row
    check_fits(config, recipe.data.seq_len * train.micro_batch_size // shared, training=True, device=device,
               dtype_bytes=size, checkpointing=train.gradient_checkpointing, chunk_tokens=train.loss_chunk_tokens,
               what=f"training at data.seq_len {recipe.data.seq_len:,} x train.micro_batch_size "
                    f"{train.micro_batch_size}", lower="data.seq_len or train.micro_batch_size")
    longest = max(recipe.eval.lengths or [recipe.data.seq_len])
    check_fits(config, longest * recipe.eval.batch_size, training=False, device=device, dtype_bytes=size,
               what=f"evaluation at length {longest:,} x eval.batch_size {recipe.eval.batch_size}",
               lower="eval.lengths or eval.batch_size")
