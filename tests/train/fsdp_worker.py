"""Run by tests/train/test_fsdp.py under torchrun (2 processes, gloo): train a patched tiny Llama sharded with FSDP2.

    python -m torch.distributed.run --nproc_per_node 2 tests/train/fsdp_worker.py MODES OUT     # MODES: full,lora

Each mode in turn, in the same two processes (one launch: its start costs more than a mode's training), into OUT/MODE.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrofit.train.fsdp import shard_model  # noqa: E402
from tests.train.fsdp_common import build, global_batch, logits_of, loss_of  # noqa: E402


def main(modes: str, out: Path) -> None:
    dist.init_process_group("gloo")
    for mode in modes.split(","):
        (out / mode).mkdir(parents=True, exist_ok=True)
        train_and_save(mode, out / mode)
    dist.destroy_process_group()


def train_and_save(mode: str, out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(mode)
    units = shard_model(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        ids = global_batch()
        loss = loss_of(model, ids[rank::world])  # equal halves: the mean of the two is the global mean
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain = build(mode)
        plain.load_state_dict(full)
        saved = plain.merge_and_unload() if mode == "lora" else plain
        saved.save_pretrained(out / "model")
        torch.save(logits_of(saved), out / "logits.pt")
        torch.save({k: v.clone() for k, v in saved.state_dict().items()}, out / "state.pt")
        (out / "result.json").write_text(json.dumps({"losses": losses, "units": units}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
