"""Serve a retrofitted model with vLLM: a plugin in vLLM's `vllm.general_plugins` group (pyproject.toml).

    pip install -e ".[serve-cpu]"          # in vLLM's own environment: docs/serving.md
    from vllm import LLM
    LLM(model="runs/smollm2-avnorm", dtype="float32").generate(["The capital of France is"])

vLLM calls `register` in every process before it builds a model. It registers RetrofitLlamaForCausalLM for the
architectures in plan.ARCHITECTURES: a checkpoint without `config.retrofit` builds vLLM's own layers, one with a
record runs the patch (AVNorm, SSMax, softmax+1 as attention sinks, RoPE extensions through vLLM's rope, NoPE) or
is refused in one line at load time (p-softmax; see plan.py). `VLLM_PLUGINS` (a comma list of plugin names) can
leave it out: then vLLM serves a patched Llama as a plain one, silently wrong.

Importing this package needs no vLLM: `register` imports it, and the model module only when vLLM builds a model.
"""

from __future__ import annotations

from .plan import ARCHITECTURES, ServePlan, serve_plan

MODEL_CLASS = "retrofit.serve.llama:RetrofitLlamaForCausalLM"

__all__ = ["ARCHITECTURES", "MODEL_CLASS", "ServePlan", "register", "serve_plan"]


def register() -> None:
    """vLLM's plugin hook: our Llama for every architecture the plugin serves (a lazy `module:class` string, so
    nothing is imported until vLLM builds a model)."""
    from vllm import ModelRegistry

    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, MODEL_CLASS)
