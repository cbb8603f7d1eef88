"""Run by tests/test_sequence_parallel.py under torchrun (2 processes, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/sequence_parallel_worker.py OUT [RECIPE [MODE]]

OUT/sharded.pt: every case of tests/sequence_parallel_common.py sharded over both processes (Ulysses). RECIPE
(train.sequence_parallel: 2) names two recipes, FULL,KILLED. MODE full (default): the cases, FULL trained, then KILLED
trained until both processes kill themselves after step 7 (as a job kill does); resume: KILLED resumed.
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from retrofit.recipe import load_recipe  # noqa: E402
from retrofit.train import train  # noqa: E402
from retrofit.train.sequence_parallel import sequence_layout, shard, sharded  # noqa: E402
from retrofit.train.tasks import loss_sum  # noqa: E402
from tests.sequence_parallel_common import CASES, batch, build, grads  # noqa: E402


def sharded_case(case: str, layout) -> dict:
    """Logits (gathered), loss (summed) and gradients (summed over the group) of one sharded forward + backward."""
    model = build(case)
    part = shard(batch(), layout)
    with sharded(model, layout):
        loss = loss_sum(model, part, "lm")
        loss.backward()
        with torch.no_grad():
            logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
    pieces = [torch.empty_like(logits) for _ in range(layout.size)]
    dist.all_gather(pieces, logits.contiguous(), group=layout.group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=layout.group)
    summed = grads(model)
    for g in summed.values():
        dist.all_reduce(g, group=layout.group)
    return {"logits": torch.cat(pieces, 1), "loss": total, "grads": summed}


def main(out: Path, recipes: str | None, mode: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if mode == "resume":
        train(load_recipe(recipes.split(",")[1]), resume=True)  # ends the process group
        return
    layout = sequence_layout(2)
    results = {case: sharded_case(case, layout) for case in CASES}
    if dist.get_rank() == 0:
        torch.save(results, out / "sharded.pt")
    if recipes is None:
        dist.destroy_process_group()
        return
    full, killed = recipes.split(",")
    train(load_recipe(full))  # ends the process group
    dist.init_process_group("gloo")

    def kill(event, step, info):
        if event == "step" and step == 7:
            os.kill(os.getpid(), signal.SIGKILL)

    train(load_recipe(killed), callbacks=[kill])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None, sys.argv[3] if len(sys.argv) > 3 else "full")
