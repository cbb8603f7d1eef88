"""Every size a user gives, checked before anything is allocated: one rule, one-line errors.

    check_size(args.samples, "--samples", MOST["samples"])      # a count: least..most, or a one-line error
    check_bytes(need, "--export-harness at length 1,000,000,000", "--lengths or --samples")   # fits in memory?

A size is refused when it is below its least, above the most the model or the machine can hold, or when what it
would allocate (estimated from the numbers alone, before anything is built) does not fit in available memory.
Each maximum below says why it is where it is; the memory of a forward pass is retrofit.memory.check_fits.
"""

from __future__ import annotations

from .errors import RetrofitError

# (most, why): the why ends the one-line error
MOST = {
    # one evaluation pass per length: a list longer than this is a typo in a range (2,3,...,100000000)
    "lengths": (256, "one evaluation pass per length; use a doubling like 256,512,...,65536"),
    # RULER instances / passkey trials / counting sequences per length (and depth): every prediction is kept in
    # results.json, and 1,000 already gives a 95% interval of +-3 points
    "samples": (100_000, "every sample's prediction is kept in results.json"),
    "trials": (100_000, "every trial is kept in results.json"),
    # a byte-level BPE of 2**20 tokens is 4x the largest vocabulary in use; the trainer aborts far beyond it
    "vocab": (1 << 20, "four times the largest vocabulary in use (256K)"),
    # RoPE context extension: 1024 x a 4K model is a 4M context; beyond, positions overflow float32
    "rope_factor": (1024, "1024 x the trained context; beyond it rotary angles lose float32 precision"),
    # text windows per length (eval --max-windows, diagnose --windows): every window's loss is kept in results.json
    "windows": (100_000, "every window's loss is kept; 1,000 windows already give a tight interval"),
    # diagnose --queries: query rows whose attention is measured per length, each row is kept in diagnose.json
    "queries": (65_536, "each measured query row is kept in diagnose.json"),
    # needle depths (eval --depths): each depth is a RULER/passkey pass per length
    "depths": (101, "one pass per depth and length; 0,0.01,...,1 is already every percent"),
    # the deepest model in use has 126 layers
    "layers": (4096, "the deepest models in use have ~126 layers"),
    # a context built without a model to size it (--export-harness): 16M tokens
    "length": (1 << 24, "16M tokens; the longest contexts in use are 1-10M"),
}


def check_size(value, what: str, most: tuple[int, str], least: int = 1):
    """`value` (an int, or a float for rope factors) within least..most, else a one-line RetrofitError naming
    `what` and the bound."""
    limit, why = most
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not least <= value <= limit:
        shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else \
            f"{value:g}" if isinstance(value, float) else repr(value)[:40]
        raise RetrofitError(f"{what} {shown} is outside {least:,}..{limit:,} ({why})")
    return value


def check_bytes(need: int, what: str, lower: str, device="cpu") -> None:
    """`need` bytes must fit in the memory available now (a one-line error naming both and what to lower)."""
    from .memory import available_bytes  # torch: imported here, so --lengths can be parsed without it

    free = available_bytes(device)
    if need > free:
        raise RetrofitError(f"{what} needs about {need / 2 ** 30:,.1f} GiB but {free / 2 ** 30:,.1f} GiB is "
                            f"available; lower {lower}")


def key_name(config, key: str) -> str:
    """The name config.json uses for a canonical attribute (GPT-2: num_attention_heads -> n_head)."""
    return getattr(config, "attribute_map", {}).get(key, key)


def check_heads(config, where: str) -> None:
    """The head counts of a model config agree with its width: the heads divide hidden_size (when no head_dim says
    otherwise) and the key/value heads divide the heads. A folder's config.json and a recipe's model.config are both
    checked here, before a module is built (GPT-2 raises deep in its attention; Llama builds and fails in the first
    forward, after the run folder was made)."""
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    width = getattr(config, "hidden_size", None)
    if _positive(heads) and _positive(width) and getattr(config, "head_dim", None) is None and width % heads:
        raise RetrofitError(f"{where}: {key_name(config, 'num_attention_heads')} ({heads}) must divide "
                            f"{key_name(config, 'hidden_size')} ({width})")
    if _positive(heads) and _positive(kv_heads) and heads % kv_heads:
        raise RetrofitError(f"{where}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _count(config, *names) -> int:
    """The first of `names` the config holds as a positive int (a wrong type is the config check's to report)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def check_model_size(config, what: str) -> None:
    """Before a model is built from `config`: at most MOST['layers'] layers, and its weights (counted from the
    config: embeddings, attention and MLP per layer; 2 bytes each, the least any float dtype takes) fit in the
    memory available now. A config claiming a million layers is refused in one line, not built for hours."""
    layers = _count(config, "num_hidden_layers", "n_layer", "num_layers")
    check_size(layers, f"{what}: num_hidden_layers", MOST["layers"], least=0)
    hidden = _count(config, "hidden_size", "n_embd", "d_model")
    inner = _count(config, "intermediate_size", "n_inner") or 4 * hidden
    params = _count(config, "vocab_size") * hidden + layers * (4 * hidden * hidden + 3 * hidden * inner)
    check_bytes(2 * params, f"{what}: {params:,} weights ({layers:,} layers, hidden {hidden:,})",
                "the model's size, or use a machine with more memory")
