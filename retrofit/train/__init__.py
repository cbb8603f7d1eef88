"""Training: an accelerate-driven pretrain/finetune loop driven by YAML recipes.

    retrofit train recipes/train-tiny-counting.yaml
    retrofit train recipes/demo.yaml train.steps=200 patch.norm=psoftmax patch.p=2
    accelerate launch -m retrofit train recipes/gpt2-avnorm-retrofit.yaml
    retrofit train RECIPE --resume runs/x

    from retrofit.train import train, load_run
    result = train(load_recipe("recipes/train-tiny-counting.yaml"))   # TrainResult: losses, evals, model
    model = load_run(result.run_dir)                                   # LM or CountingModel, ready to evaluate

Modules: loop (the loop), build (accelerator, model, optimizer, schedule), tasks (losses, evaluation,
saving/loading runs, the counting head), checkpoint (atomic resumable state), runlog (log.jsonl),
command (the CLI).
"""

from .command import add_arguments, run
from .loop import TrainResult, setup, train
from .runlog import read_log
from .tasks import CountingModel, load_run

__all__ = ["CountingModel", "TrainResult", "add_arguments", "load_run", "read_log", "run", "setup", "train"]
