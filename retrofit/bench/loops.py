"""The two training loops the train benchmarks compare, on one model and the same random tokens: retrofit's
(`retrofit.train.train` from a small recipe) and Hugging Face Trainer's. Each returns (step, time) at every log.
Used by `retrofit bench train` (train.py: tokens/s) and `--memory` (train_memory.py: peak memory, a process each).
"""

from __future__ import annotations

import time
from pathlib import Path

SIZES = {  # small enough for a CPU, with a real vocabulary so the LM head costs what it costs
    "gpt2": dict(n_embd=128, n_layer=2, n_head=4, n_positions=1024, vocab_size=50257,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, vocab_size=50257),
}

class RandomTokens:
    """The data interface of retrofit.data for uniform random tokens (the same rows the Trainer gets)."""

    task = "lm"

    def __init__(self, rows):
        self.rows = rows  # (N, T) LongTensor

    def batch(self, step, rows, length):
        ids = self.rows[(step * rows) % len(self.rows):][:rows]
        return {"input_ids": ids, "labels": ids}

    def eval_batches(self, length, batches, batch_size):
        return []

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def bench_model(args):
    from ..load import model_from_config
    from ..patching import patch
    model = model_from_config(args.model_type, seed=0, **SIZES[args.model_type])
    if args.norm:
        patch(model, args.norm)
    return model


def bench_recipe(args, workdir: Path, model_type: str, **knobs):
    """The recipe both benchmarks train retrofit's loop with (the model and data are passed in directly; the
    recipe's tokenizer/files are never read); knobs: more train.* settings."""
    from ..recipe import recipe_from_dict
    return recipe_from_dict({
        "name": "bench", "model": {"config": {"model_type": model_type}, "tokenizer": "unused"},
        "data": {"task": "lm", "seq_len": args.seq_len, "files": ["unused"]},
        "train": {"steps": args.steps, "batch_size": args.batch, "micro_batch_size": args.batch, "lr": 1e-4,
                  "warmup_steps": args.warmup, "precision": args.precision, "log_every": args.warmup,
                  "progress": False, "cpu": args.cpu, "sequence_parallel": getattr(args, "sequence_parallel", 1),
                  **knobs},
        "output": {"dir": str(workdir)}})


def run_retrofit(args, rows, workdir: Path, model=None, **knobs) -> list[float]:
    from ..train import train
    model = model if model is not None else bench_model(args)
    recipe = bench_recipe(args, workdir, model.config.model_type, **knobs)
    stamps = []  # (step, time) at every log
    train(recipe, model=model, data=RandomTokens(rows), callbacks=[
        lambda event, step, info: stamps.append((step, time.perf_counter())) if event == "step" else None])
    return stamps


def run_trainer(args, rows, workdir: Path, model=None, gradient_checkpointing: bool = False) -> list[float]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    on_gpu = torch.cuda.is_available() and not args.cpu
    stamps = []

    class Stamp(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:  # not the end-of-training summary, which is logged after the last step
                stamps.append((state.global_step, time.perf_counter()))

    dataset = [{"input_ids": r, "labels": r} for r in rows]
    targs = TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-4,
        warmup_steps=args.warmup, lr_scheduler_type="cosine", weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0,
        bf16=args.precision == "bf16", use_cpu=not on_gpu,  # optim: Trainer's default, adamw_torch_fused
        logging_steps=args.warmup, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_level="error", dataloader_num_workers=0, seed=0, gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if gradient_checkpointing else None)
    model = model if model is not None else bench_model(args)
    Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[Stamp()]).train()
    return stamps


