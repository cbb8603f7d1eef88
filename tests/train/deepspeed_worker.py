"""Run by tests/train/test_deepspeed.py under a launcher that asks for DeepSpeed (accelerate launch --config_file).

    accelerate launch --config_file ds_zero3.yaml tests/train/deepspeed_worker.py RECIPE[,RECIPE...] [MODE]

MODE full (default): each recipe in turn, the process group kept between them (a run ends the group, and a run in
a new group would meet the previous one's rendezvous keys on the launcher's store); kill:N: the one recipe until
both processes kill themselves after step N, as a job kill does; resume: the one recipe resumed from its run folder,
every torch.load of DeepSpeed's checkpoint files recorded in RUN/loads.json (the test asserts weights_only).
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from retrofit.recipe import load_recipe  # noqa: E402
from retrofit.train import train  # noqa: E402


def record_loads(run_dir: Path):
    """Wrap torch.load: every call reading a file under a checkpoint's deepspeed/ folder is noted with its
    weights_only argument, written to run_dir/loads.json by the main process at the end."""
    seen, load = [], torch.load

    def recording(f, *args, **kwargs):
        if "/deepspeed/" in str(f):
            seen.append({"file": Path(str(f)).name, "weights_only": kwargs.get("weights_only")})
        return load(f, *args, **kwargs)

    torch.load = recording
    return seen


def main(recipes: str, mode: str) -> None:
    torch.set_num_threads(1)
    kill_step = int(mode.split(":")[1]) if mode.startswith("kill:") else None

    def kill(event, step, info):
        if event == "step" and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    *first, last = recipes.split(",")
    if first:
        end = dist.destroy_process_group
        dist.destroy_process_group = lambda *a, **k: None  # keep the group for the next run
        for each in first:
            train(load_recipe(each))
        dist.destroy_process_group = end
    recipe = load_recipe(last)
    seen = record_loads(Path(recipe.output.dir)) if mode == "resume" else None
    train(recipe, callbacks=[kill], resume=mode == "resume")  # ends the process group
    if seen is not None and os.environ.get("RANK", "0") == "0":
        (Path(recipe.output.dir) / "loads.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "full")
