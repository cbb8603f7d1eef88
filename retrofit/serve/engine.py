"""A vLLM engine for a retrofit checkpoint, checked in this process first.

    llm = load_llm("runs/smollm2-avnorm", dtype="float32")     # vllm.LLM; any LLM keyword passes through

vLLM builds the model in its engine process, where a refusal (retrofit.serve.plan) ends its start-up with a long
log; `load_llm` reads the same plan from config.json here first, so a checkpoint vLLM cannot serve exactly is
refused in one line before any engine starts, and so is an environment whose VLLM_PLUGINS leaves the plugin out
(vLLM would then serve a patched Llama as a plain one, silently).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import RetrofitError, read_utf8
from .plan import ServePlan, serve_plan

PLUGIN = "retrofit"  # our entry point's name in vLLM's plugin group (pyproject.toml)


def checkpoint_plan(folder: str | os.PathLike) -> ServePlan | None:
    """The ServePlan of a local checkpoint folder's config.json (None: not patched)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise RetrofitError(f"{folder} has no config.json: pass a saved model folder (retrofit patch --out, "
                            "save_pretrained, a training run's model)")
    try:
        config = json.loads(read_utf8(path))
    except json.JSONDecodeError as err:
        raise RetrofitError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    return serve_plan(config, where=str(folder))


def check_plugin_enabled() -> None:
    """vLLM loads every installed plugin unless VLLM_PLUGINS names the ones to load."""
    chosen = os.environ.get("VLLM_PLUGINS")
    if chosen is not None and PLUGIN not in [name.strip() for name in chosen.split(",")]:
        raise RetrofitError(f"VLLM_PLUGINS={chosen!r} leaves out {PLUGIN!r}: vLLM would serve a patched model as "
                            "the original; add it, or unset VLLM_PLUGINS")


def load_llm(folder: str | os.PathLike, **engine):
    """vllm.LLM(model=folder, **engine) once the checkpoint's plan and the plugin are checked."""
    plan = checkpoint_plan(folder)
    if plan is not None:
        check_plugin_enabled()
    try:
        import vllm
    except ImportError:
        raise RetrofitError("vLLM is not installed here: install retrofit's serve extra in its own environment "
                            "(docs/serving.md)") from None
    return vllm.LLM(model=str(folder), **engine)
