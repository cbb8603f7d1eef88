"""retrofit.memory.PeakMemory: catches a freed spike, does not carry one block's peak into the next."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from retrofit import memory

MB = 2 ** 20


def spike(mb: int, hold_s: float = 0.0) -> None:
    x = torch.ones(mb * MB // 4)  # touched: resident, not just reserved
    time.sleep(hold_s)
    del x


@pytest.mark.skipif(not memory._clear_refs_works(), reason="needs a writable /proc/self/clear_refs (Linux)")
def test_high_water_mark_catches_a_freed_spike():
    with memory.PeakMemory("cpu") as m:
        spike(200)  # allocated and freed within the block, far faster than any sampling interval
    assert m.method == "VmHWM after clear_refs" and m.kind == "rss"
    assert 190 <= m.added_mb <= 260
    with memory.PeakMemory("cpu") as again:  # the next block starts from the current resident set
        pass
    assert again.added_mb < 20 and again.start_mb < m.peak_mb - 150


def test_sampling_fallback(monkeypatch):
    monkeypatch.setattr(memory, "_clear_refs_works", lambda: False)
    with memory.PeakMemory("cpu") as m:
        spike(200, hold_s=0.2)  # held for 20 sampling intervals
    assert m.method == "RSS sampled every 10 ms"
    assert 190 <= m.added_mb <= 260
    assert not m._thread.is_alive()


def test_rss_matches_the_kernel_or_psutil():
    import psutil
    assert abs(memory.rss_mb() - psutil.Process().memory_info().rss / MB) < 50


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_peak():
    with memory.PeakMemory("cuda") as m:
        x = torch.ones(100 * MB // 4, device="cuda")
        del x
    assert m.kind == "cuda_allocated" and 99 <= m.added_mb <= 110



RETAINED = """
import ctypes, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from retrofit.memory import return_freed_memory, rss_mb
from retrofit.train.model_setup import enable_gradient_checkpointing
was_set = sys.argv[1] == "set" and return_freed_memory()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
enable_gradient_checkpointing(model)
hidden = model.model(input_ids=torch.randint(0, 256, (1, 2048))).last_hidden_state  # each layer's inner tensors freed
resident = rss_mb()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(was_set, resident - rss_mb())  # MiB of freed memory that had stayed resident
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_checkpointed_forward_leaves_no_freed_activations_resident_once_the_threshold_is_fixed():
    """A fresh process each (the setting is process-wide and permanent). Under gradient checkpointing each layer's
    inner tensors (2-8 MiB here) are made and freed in the forward; glibc keeps them resident (~100 MiB here; +2 GiB
    on SmolLM2-135M's 8K step) unless return_freed_memory, which the training loop calls on the CPU, is set."""
    def retained(mode):
        out = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        was_set, mb = out.stdout.split()
        return was_set, float(mb)
    was_set, fixed = retained("set")
    assert was_set == "True" and fixed < 16
    assert retained("default")[1] > 48


@pytest.mark.parametrize("release", [True, False])
def test_the_loop_sets_the_threshold_only_when_the_recipe_asks(release, tmp_path, monkeypatch):
    """train.cpu_release_memory (default true) decides whether the CPU loop fixes glibc's threshold; it changes no
    result, so a run may resume with it changed."""
    from retrofit.recipe import recipe_from_dict
    from retrofit.train import loop, resume_state, train
    calls = []
    monkeypatch.setattr(loop, "return_freed_memory", lambda *a: calls.append(a) or True)
    raw = {"model": {"config": {"model_type": "gpt2"}}, "data": {"task": "counting", "seq_len": 16},
           "train": {"steps": 1, "batch_size": 2, "micro_batch_size": 2, "progress": False,
                     "cpu_release_memory": release},
           "eval": {"lengths": [16], "batches": 1}, "output": {"dir": str(tmp_path / "run")}}
    train(recipe_from_dict(raw))
    assert calls == ([()] if release else [])
    flat = {"train.cpu_release_memory": release, "train.lr": 1e-3}
    resume_state.check_same_recipe(flat, {**flat, "train.cpu_release_memory": not release}, tmp_path)  # no error
