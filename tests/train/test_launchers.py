"""The commands for several processes on a CPU that docs/many-gpus.md gives are run here exactly as written: the
`ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2` line and the `torchrun` line each start two
gloo processes that train 6 tiny steps together (the torchrun launch is shared with tests/train/test_train.py).
(`accelerate launch --cpu --num_processes 2` starts one.) Its "Many nodes" lines start two "nodes" of one process
each on this machine, rendezvousing on 127.0.0.1, for torchrun and for accelerate."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tiny import TINY

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "many-gpus.md"  # the guide that gives these lines (the README links to it)
LAUNCHERS = {"accelerate": "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes",
             "torchrun": "torchrun --standalone"}


def page_line(start: str) -> str:
    """The page's command line that starts with `start`, its trailing comment cut."""
    lines = [line for line in PAGE.read_text().splitlines() if line.startswith(start)]
    assert len(lines) == 1, f"{PAGE.name} should have one command starting {start!r}, has {len(lines)}"
    return lines[0].split("  #")[0].strip()


def as_argv(line: str, recipe: Path, out: Path) -> tuple[dict, list[str]]:
    """(environment assignments, argv): RECIPE and runs/x become the test's; the launcher is this Python's."""
    words = [str(recipe) if w == "RECIPE" else str(out) if w == "runs/x" else w for w in shlex.split(line)]
    env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
    argv = [w for w in words if w.split("=", 1)[0] not in env]
    program = Path(sys.executable).parent / argv[0]  # the console script next to this interpreter
    if not program.is_file():
        pytest.skip(f"{argv[0]} is not installed next to {sys.executable}")
    return env, [str(program), *argv[1:]]


def two_process_recipe(folder: Path) -> Path:
    """A tiny GPT-2 with AVNorm counting, 6 steps of a global batch of 4 (2 micro-batches of 2 on one process, one
    on each of two), evaluated at 32 and 64: what test_train compares with one process."""
    raw = {"model": {"config": {"model_type": "gpt2", **TINY["gpt2"], "vocab_size": 16}}, "patch": {"norm": "avnorm"},
           "data": {"task": "counting", "seq_len": 32},
           "train": {"steps": 6, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 2,
                     "progress": False, "log_every": 1},
           "eval": {"lengths": [32, 64], "batches": 1, "batch_size": 3}}
    recipe = folder / "ddp.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def launch(launcher: str, folder: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The guide's line for `launcher` on two_process_recipe: (the finished process, the recipe, the run folder)."""
    recipe, out = two_process_recipe(folder), folder / "run"
    env, argv = as_argv(page_line(LAUNCHERS[launcher]), recipe, out)
    done = subprocess.run(argv, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=300, cwd=folder)
    return done, recipe, out


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_the_guides_cpu_launch_line_starts_two_processes(launcher, tmp_path, torchrun_launch):
    # torchrun's launch is shared with tests/train/test_train.py (tests/conftest.py): one start of three processes less
    done, _, out = torchrun_launch if launcher == "torchrun" else launch(launcher, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert (result["processes"], result["steps"]) == (2, 6)
    assert result["engine"] == {"name": "ddp", "world": 2, "backend": "gloo", "nodes": 1, "stage": None,
                                "sequence_parallel": 1}


# ---- two nodes on this machine: the guide's many-node lines, one launcher per "node", rendezvous on 127.0.0.1 -------

NODE_LINES = {"torchrun": "torchrun --nnodes 2",
              "accelerate": "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_machines"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("launcher", sorted(NODE_LINES))
def test_two_nodes_rendezvousing_on_127_0_0_1_train_like_one_process(launcher, tmp_path):
    """docs/many-gpus.md's "Many nodes" lines for one machine, run as written: two launchers (node ranks 0 and 1,
    one CPU process each) meet at 127.0.0.1; the run records 2 nodes and logs one process's losses (1e-5)."""
    from retrofit.recipe import load_recipe
    from retrofit.train import train
    from tests.train.test_train import losses_of
    recipe, out, port = two_process_recipe(tmp_path), tmp_path / "run", str(free_port())
    line = page_line(NODE_LINES[launcher]).replace("29500", port)
    nodes = []
    for rank in ("0", "1"):
        env, argv = as_argv(line.replace("$NODE_RANK", rank), recipe, out)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
        nodes.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=tmp_path))
    done = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], done[0][1][-3000:] + done[1][1][-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["engine"] == {"name": "ddp", "world": 2, "backend": "gloo", "nodes": 2, "stage": None,
                                "sequence_parallel": 1}
    one = train(load_recipe(recipe, [f"output.dir={tmp_path / 'one'}"]))
    two = losses_of(out)
    assert sorted(two) == sorted(one.losses) == list(range(1, 7))
    assert max(abs(two[s] - one.losses[s]) for s in two) <= 1e-5, (two, one.losses)
