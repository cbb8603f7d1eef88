"""Run by tests/train/test_sequence_parallel.py under torchrun (2 processes, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/train/sequence_parallel_worker.py OUT [RECIPE [MODE]]
    python -m torch.distributed.run --nproc_per_node 4 tests/train/sequence_parallel_worker.py OUT RECIPE,RECIPE groups

OUT/sharded.pt: every case of tests/train/sequence_parallel_common.py sharded over both processes (Ulysses); MODE
alst (no RECIPE): OUT/alst.pt, every case sharded by DeepSpeed's ALST around retrofit's adapter instead. RECIPE
(train.sequence_parallel: 2) is then trained; MODE full (default) to the end; kill:N (no parity cases) until both
processes kill themselves after step N, as a job kill does; resume (no parity cases): resumed from its run folder;
groups (no parity cases): each recipe in turn, the process group kept between them (a run ends the group, and a
run in a new group would meet the previous one's rendezvous keys on torchrun's store).
"""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrofit.recipe import load_recipe  # noqa: E402
from retrofit.train import train  # noqa: E402
from retrofit.train.alst import preparing, reset_alst  # noqa: E402
from retrofit.train.losses import loss_sum  # noqa: E402
from retrofit.train.sequence_parallel import ALST_NAME, sequence_layout, shard, sharded  # noqa: E402
from tests.train.sequence_parallel_common import CASES, batch, build, grads  # noqa: E402


def alst(model, layout):
    """DeepSpeed's ALST registered around retrofit's adapter for `model`, as accelerate's prepare() does under
    train.sequence_parallel with DeepSpeed (inside the same `preparing` block the training loop uses)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    reset_alst()
    with preparing(model, layout):
        UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=ALST_NAME,
                                                        sequence_parallel_size=layout.size, micro_batch_size=2,
                                                        seq_length_is_variable=True)


def sharded_case(case: str, layout) -> dict:
    """Logits (gathered), loss (summed) and gradients (summed over the group) of one sharded forward + backward."""
    model = build(case)
    part = shard(batch(), layout)
    if layout.alst:
        alst(model, layout)
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


def main(out: Path, recipe: str | None, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a mismatch fails instead of waiting 30 min
    torch.set_num_threads(1)
    if mode in ("full", "alst"):  # the parity cases
        if mode == "alst":
            import deepspeed
            deepspeed.init_distributed("gloo")
        results = {case: sharded_case(case, sequence_layout(2, alst=mode == "alst")) for case in CASES}
        if dist.get_rank() == 0:
            torch.save(results, out / f"{'alst' if mode == 'alst' else 'sharded'}.pt")
    if recipe is None:
        dist.destroy_process_group()
        return
    kill_step = int(mode.split(":")[1]) if mode.startswith("kill:") else None

    def kill(event, step, info):
        if event == "step" and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    if mode == "groups":
        *first, last = recipe.split(",")
        end = dist.destroy_process_group
        dist.destroy_process_group = lambda *a, **k: None  # keep the group for the next run
        for each in first:
            train(load_recipe(each))
        dist.destroy_process_group, recipe = end, last
    train(load_recipe(recipe), callbacks=[kill], resume=mode == "resume")  # ends the process group


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None,
         sys.argv[3] if len(sys.argv) > 3 else "full")
