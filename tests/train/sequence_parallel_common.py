"""The models and batch that tests/train/test_sequence_parallel.py and tests/train/sequence_parallel_worker.py share
(one place, so the sharded run and the one-process reference cannot drift apart)."""

import torch
from peft import LoraConfig, get_peft_model

import retrofit
from retrofit.train import model_setup
from tests.tiny import random_ids, tiny_model

# case -> (model type, config overrides, norm, norm options). Tiny models have 4 query heads, 2 KV heads.
CASES = {
    "unpatched": ("llama", {}, None, {}),
    "softmax": ("llama", {}, "softmax", {}),
    "avnorm-rms": ("llama", {}, "avnorm", {"affine": True}),
    "avnorm-beyond": ("llama", {}, "avnorm", {"mode": "beyond", "ref_len": 4}),  # active: 16 keys > L = 4
    "psoftmax-p2": ("llama", {}, "psoftmax", {"p": 2, "gain": 1.0}),
    "ssmax": ("llama", {}, "ssmax", {}),
    "softmax1": ("llama", {}, "softmax1", {"learnable": True}),
    "gqa-1kv-psoftmax": ("llama", {"num_key_value_heads": 1}, "psoftmax", {"p": 2}),  # fewer KV heads than ranks
    "gqa-1kv-eager-ssmax": ("llama", {"num_key_value_heads": 1, "attn_implementation": "eager"}, "ssmax", {}),
    "gpt2-softmax1": ("gpt2", {}, "softmax1", {"learnable": True}),  # learned absolute positions
    "lora-checkpointing-ssmax": ("llama", {}, "ssmax", {}),
    "bf16-softmax1": ("llama", {}, "softmax1", {"learnable": True}),  # weights and activations in bf16
}


def build(case: str):
    """The case's tiny model, patched, its per-head parameters made distinct per head (a wrong slice shows)."""
    model_type, overrides, norm, options = CASES[case]
    model = tiny_model(model_type, seed=0, **overrides)
    if norm is not None:
        retrofit.patch(model, norm, **options)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.1 * torch.arange(p.numel(), dtype=p.dtype).view_as(p))
    if case.startswith("bf16"):
        model.to(torch.bfloat16)
    if case.startswith("lora"):
        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["retrofit"])
        model = get_peft_model(model, config)
        with torch.no_grad():  # LoRA's B starts at zero: make the adapters act, so their gradients are all non-zero
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        model_setup.enable_gradient_checkpointing(model)
    return model.train()


def batch() -> dict:
    ids = random_ids(batch=2, length=16, seed=3)
    return {"input_ids": ids, "labels": ids.clone()}


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
