"""The training bar's clock: its s/step (and the ETA from it) and the log's tokens/s count training only.

    clock = StepClock()                                   # the Run's; the log window reads it too
    bar = step_bar(clock, total=100, initial=40, unit="step")   # resumed at step 40: the rate starts there
    with clock.paused(device):                            # an evaluation or a checkpoint: not training
        ...

Issue 62 (item 6): tqdm's rate is wall time over the steps its bar moved, so the evaluations and checkpoint saves
between steps counted as training, and its closing line (the run's mean rate) took in the final evaluation and the
last checkpoint. The log's tokens/s had the same fault: a log window's clock ran through the evaluation and the
checkpoint that follow the log line opening it. Both now read this clock, which the loop stops for every evaluation
(periodic and final, their "eval" callbacks included) and every checkpoint save. What a log step adds (the loss
reduced across processes, the trackers written, the "step" callbacks) stays on it: the loop pays it every log step.
"""

from __future__ import annotations

import contextlib
from time import perf_counter

import torch


class StepClock:
    """Seconds of training: wall time since the clock was made, less every pause. Callable: `clock()`. This module's
    perf_counter is read at each call, so a test can replace it with a clock it moves by hand."""

    def __init__(self):
        self.started, self.paused_s = perf_counter(), 0.0

    def __call__(self) -> float:
        return perf_counter() - self.started - self.paused_s

    @contextlib.contextmanager
    def paused(self, device: torch.device):
        """The block's seconds are not training. On a GPU the steps' queued kernels finish first, on the clock: the
        evaluation's first read of a result would otherwise wait for them inside the pause."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begun = perf_counter()
        try:
            yield
        finally:
            self.paused_s += perf_counter() - begun


def step_bar(clock: StepClock, **tqdm_args):
    """tqdm's bar (tqdm.auto: a terminal or a notebook) whose rate is the steps it moved since it was made (from
    `initial`, the resumed step) over `clock`'s seconds since then. format_dict is tqdm's documented seam for what a
    bar shows; only the rate is replaced (the elapsed time stays the wall's), before and at close alike."""
    from tqdm.auto import tqdm

    begun = clock()

    class StepBar(tqdm):
        @property
        def format_dict(self):
            shown = super().format_dict
            if "initial" in shown:  # not on a bar made disabled (tqdm's __init__ returns early); at close, yes
                steps, seconds = self.n - self.initial, clock() - begun
                shown["rate"] = steps / seconds if steps > 0 and seconds > 0 else None
            return shown

    return StepBar(**tqdm_args)
