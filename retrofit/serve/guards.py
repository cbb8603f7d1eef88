"""Guards: vLLM's own model classes for the architectures in plan.GUARDED, refusing a patched checkpoint.

    ModelRegistry.register_model("Qwen2ForCausalLM", "retrofit.serve.guards:Qwen2ForCausalLM")   # register() does

`retrofit.serve.guards.<Architecture>` is a subclass of vLLM's class whose __init__ first reads config.retrofit
(plan.serve_plan): a plain checkpoint builds vLLM's model unchanged; a patched one is refused in one line ("serves
LlamaForCausalLM checkpoints, not Qwen2ForCausalLM"), where plain vLLM would serve it as the original model. The
class is made when vLLM resolves the name (module __getattr__), so importing this module imports no vLLM model.
"""

from __future__ import annotations

import importlib

from .plan import GUARDED, serve_plan


def guarded(architecture: str) -> type:
    """vLLM's class for `architecture`, refusing a patched checkpoint before it builds anything."""
    module, name = GUARDED[architecture]
    base = getattr(importlib.import_module(module), name)

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        serve_plan(vllm_config.model_config.hf_config, where=str(vllm_config.model_config.model))
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)

    return type(architecture, (base,), {"__init__": __init__, "__module__": __name__, "__qualname__": architecture,
                                        "__doc__": f"vLLM's {name}, refusing checkpoints with config.retrofit"})


def __getattr__(name: str):
    if name in GUARDED:
        return guarded(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
