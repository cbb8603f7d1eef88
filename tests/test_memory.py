"""retrofit.memory.PeakMemory: catches a freed spike, does not carry one block's peak into the next."""

from __future__ import annotations

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
