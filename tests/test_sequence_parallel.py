"""Ulysses sequence parallelism on CPU (2 processes, gloo): for every norm, GQA with fewer KV heads than ranks,
eager, GPT-2's learned positions and LoRA + gradient checkpointing, the sharded forward's logits and gradients
equal one process's (fp32, 1e-5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from retrofit.errors import RetrofitError
from retrofit.train.sequence_parallel import SequenceLayout, shard
from retrofit.train.tasks import loss_sum
from tests.sequence_parallel_common import CASES, batch, build, grads

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def launch(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "sequence_parallel_worker.py"), str(out), *args],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    proc = launch(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "sharded.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_logits_and_gradients_equal_one_process(case, sharded):
    torch.set_num_threads(1)
    model = build(case)
    loss = loss_sum(model, batch(), "lm")
    loss.backward()
    with torch.no_grad():
        logits = model(input_ids=batch()["input_ids"], use_cache=False).logits
    got = sharded[case]
    torch.testing.assert_close(got["logits"], logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-6, atol=1e-5)
    reference = grads(model)
    assert got["grads"].keys() == reference.keys() and reference
    for name, g in reference.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=1e-5, msg=name)
    patch_grads = [g for n, g in reference.items() if ".retrofit." in n]
    assert all(g.abs().min() > 0 for g in patch_grads)  # every head of a per-head parameter got its gradient


def test_shard_scores_the_token_after_a_boundary():
    layout = SequenceLayout(size=2, rank=0, data_rank=0, data_size=1)
    part = shard(batch(), layout)
    ids = batch()["input_ids"]
    assert torch.equal(part["shift_labels"][:, -1], ids[:, 8])  # rank 0's last token predicts rank 1's first
    assert torch.equal(shard(batch(), SequenceLayout(2, 1, 0, 1))["position_ids"][0], torch.arange(8, 16))
    with pytest.raises(RetrofitError, match="not a multiple of train.sequence_parallel"):
        shard({"input_ids": ids[:, :15]}, layout)
    with pytest.raises(RetrofitError, match="padded rows"):
        shard({**batch(), "attention_mask": torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0)}, layout)
