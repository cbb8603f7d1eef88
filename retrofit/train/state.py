"""What the training loop carries from step to step, in one place (torchtune's recipes keep the same on `self`).

    run.result      TrainResult: steps done, logged losses, evaluations (what train() returns)
    run.clock       seconds of training, stopped for evaluations and checkpoints: the bar's s/step, tokens/s
    run.window      the open log window: loss sum, items, tokens since the last log line
    run.divergence  the first step whose loss or gradient norm was not finite, kept on the device

loop.py builds one Run and hands it to each step; update.py is one optimizer update on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import RetrofitError
from ..recipe import Recipe
from .engine import Engine
from .progress import StepClock


@dataclass
class TrainResult:
    run_dir: Path
    steps: int                                                   # optimizer steps completed
    losses: dict[int, float] = field(default_factory=dict)      # step -> mean training loss of its log window
    evals: dict[int, dict] = field(default_factory=dict)        # step -> eval metrics
    resumed_from: int | None = None
    model: nn.Module | None = None                               # the trained model, as saved


@dataclass(frozen=True)
class Split:
    """This process's share of every global batch: its rank among `world` data-parallel groups, `accum`
    micro-batches per step, and the sequence-parallel layout (train.sequence_parallel; None: whole rows)."""

    layout: Any
    rank: int
    world: int
    accum: int


@dataclass
class LogWindow:
    """The open log window: the loss sum since the last log line (on the device, so no step waits on the host),
    the items and tokens it covers, and when it opened: a reading of the run's clock (training seconds, progress.py)."""

    loss: torch.Tensor                 # float64, 0-d
    items: int = 0
    tokens: int = 0
    opened: float = 0.0

    def reset(self, now: float) -> None:
        self.loss.zero_()
        self.items, self.tokens, self.opened = 0, 0, now


@dataclass
class Divergence:
    """The first step whose loss or gradient norm was not finite (0: none). Noted on the device every step, so no
    step waits on the host; read by all processes together (so every one decides alike) at log steps and before
    anything is saved, so no checkpoint is written from a diverged step."""

    first_bad: torch.Tensor            # long, 0-d

    def note(self, step: int, finite: torch.Tensor) -> None:
        self.first_bad = torch.where((self.first_bad == 0) & ~finite, step, self.first_bad)

    def check(self, accelerator) -> None:
        bad = [s for s in accelerator.gather(self.first_bad.reshape(1)).tolist() if s]
        if bad:
            raise RetrofitError(f"the training loss is not finite (nan or inf) at step {min(bad)}; nothing was saved "
                                f"from it: lower train.lr or check the data")


@dataclass
class Run:
    """Everything the loop reads and changes; each step of loop.py and update.py takes it and nothing else."""

    recipe: Recipe
    acc: Any                           # the accelerate.Accelerator
    run_dir: Path
    split: Split
    model: nn.Module                   # as accelerate prepared it
    optimizer: Any
    data: Any
    tokenizer: Any
    recovery: Any                      # the recipe's recovery section (retrofit.recovery), or None
    schedule: Any                      # its schedule, costs measured when the recipe asked; None: no schedule
    callbacks: tuple
    from_recipe: bool                  # a LoRA adapter can only be rebuilt on a base the recipe describes
    flat: dict                         # the recipe flattened: checkpoints and trackers record it
    trainable: list                    # parameters that train: clipped, checked for finite weights before a save
    base: list                         # those not the patch's: no update during recovery.match_steps
    result: TrainResult
    window: LogWindow
    divergence: Divergence
    engine: Engine                     # what trains the run (engine.py): result.json and the log's first line name it
    clock: StepClock = field(default_factory=StepClock)  # seconds of training: evaluations, checkpoints left out

    def notify(self, event: str, step: int, **info) -> None:
        """Call the callbacks: fn(event, step, info), info holding the accelerator too."""
        for fn in self.callbacks:
            fn(event, step, {"accelerator": self.acc, **info})


@dataclass(frozen=True)
class StepStats:
    """What one update reports to the log."""

    length: int                        # the step's sequence length (train.init_len stages it)
    lr: float
    grad_norm: torch.Tensor | None     # before clipping; None when train.grad_clip is 0
