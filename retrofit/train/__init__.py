"""Training: an accelerate-driven pretrain/finetune loop driven by YAML recipes.

    retrofit train recipes/train-tiny-counting.yaml
    retrofit train recipes/demo.yaml train.steps=200 patch.norm=psoftmax patch.p=2
    accelerate launch -m retrofit train recipes/gpt2-avnorm-retrofit.yaml
    retrofit train RECIPE --resume runs/x

    from retrofit.train import train
    result = train(load_recipe("recipes/train-tiny-counting.yaml"))   # TrainResult: losses, evals, model
    model = retrofit.load.load(result.run_dir)                         # LM or CountingModel, ready to evaluate

Modules: loop (the loop, step by step), state (the Run it carries), update (one optimizer update),
accelerator_setup (the Accelerator, gradient accumulation; the processes' end), run_checks (what a loaded model cannot
train, refused before step 1), model_setup (task wrapper, calibration, LoRA, gradient checkpointing), optimizer_setup
(parameter groups, freeze_base, AdamW), schedules (learning rate, staged length), losses (each task's loss), validation
(the periodic metrics), resume_state (atomic resumable checkpoints), runlog (log.jsonl), engine (what the launch asks
for: honored or refused; what ran), recipe_fits (a recipe checked before the model is built), dry_run (--dry-run: the
peak memory a recipe needs), fsdp (FSDP2 units), zero (DeepSpeed ZeRO through accelerate, CPU processes too),
sequence_parallel (train.sequence_parallel: Ulysses, N processes per row), alst (the same under DeepSpeed: its ALST
around retrofit's head slicing). Loading the model and saving the final one is retrofit.load; the CLI is
retrofit/commands/train.py.
"""

from .loop import TrainResult, setup, train
from .runlog import read_log

__all__ = ["TrainResult", "read_log", "setup", "train"]
