"""The model, data and loss that tests/train/test_fsdp.py and tests/train/fsdp_worker.py share (one place, so the
sharded run and the single-process reference cannot drift apart)."""

import torch
from peft import LoraConfig, get_peft_model

import retrofit
from retrofit.train import losses
from tests.tiny import tiny_model


def build(mode: str):
    """full: fp32 patched Llama, all weights train. lora: bf16 base + avnorm + LoRA (fp32 adapters, the patch
    trained through modules_to_save): the mixed-dtype case FSDP2 refuses without uniform units."""
    model = tiny_model("llama", seed=0)
    if mode == "full":
        retrofit.patch(model, "avnorm", affine=True)
        return model.train()
    model = model.to(torch.bfloat16)
    retrofit.patch(model, "avnorm")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["retrofit"])
    torch.manual_seed(1)
    return get_peft_model(model, config).train()


def global_batch(seed: int = 0) -> torch.Tensor:
    """4 rows of 16 random tokens; training steps reuse one batch, so a falling loss shows learning."""
    return torch.randint(3, 90, (4, 16), generator=torch.Generator().manual_seed(100 + seed))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    """The training loop's loss (retrofit.train.losses.loss_sum: the head chunked and checkpointed outside the
    model's forward, so FSDP2's gathered head weight must get its gradient), as a mean over scored tokens."""
    batch = {"input_ids": ids, "labels": ids}
    return losses.loss_sum(model, batch, "lm", chunk_tokens=8) / losses.items(batch, "lm")


@torch.no_grad()
def logits_of(model) -> torch.Tensor:
    return model.eval()(input_ids=global_batch(99), use_cache=False).logits.float()
