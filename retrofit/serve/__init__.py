"""Serve a retrofitted model with vLLM: a plugin in vLLM's `vllm.general_plugins` group (pyproject.toml).

    pip install -e ".[serve-cpu]"          # in vLLM's own environment: docs/serving.md
    from vllm import LLM
    LLM(model="runs/smollm2-avnorm", dtype="float32").generate(["The capital of France is"])

vLLM calls `register` in every process before it builds a model. It registers RetrofitLlamaForCausalLM for the
architectures in plan.ARCHITECTURES: a checkpoint without `config.retrofit` builds vLLM's own layers, one with a
record runs the patch (AVNorm, SSMax, softmax+1 as attention sinks, RoPE extensions through vLLM's rope, NoPE) or
is refused in one line at load time (p-softmax; see plan.py). The other architectures retrofit patches
(plan.GUARDED: Qwen2, Mistral, Gemma, GPT-2, ...) get guards (guards.py): vLLM's own model, refusing a patched
checkpoint. `VLLM_PLUGINS` (a comma list of plugin names) can leave the plugin out: then vLLM serves a patched
model as a plain one, silently wrong (retrofit.serve.load_llm refuses that).

Importing this package needs no vLLM: `register` imports it, and the model module only when vLLM builds a model.
"""

from __future__ import annotations

from .plan import ARCHITECTURES, GUARDED, ServePlan, serve_plan
from .vllm_engine import load_llm

MODEL_CLASS = "retrofit.serve.llama:RetrofitLlamaForCausalLM"
GUARD_MODULE = "retrofit.serve.guards"

__all__ = ["ARCHITECTURES", "GUARDED", "MODEL_CLASS", "ServePlan", "load_llm", "register", "serve_plan"]


def register() -> None:
    """vLLM's plugin hook: our Llama for every architecture the plugin serves (a lazy `module:class` string, so
    nothing is imported until vLLM builds a model)."""
    from vllm import ModelRegistry

    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, MODEL_CLASS)
    for architecture in GUARDED:  # patched ones refused in one line; plain ones are vLLM's model as it is
        ModelRegistry.register_model(architecture, f"{GUARD_MODULE}:{architecture}")
