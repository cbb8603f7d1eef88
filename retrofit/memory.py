"""Peak memory while a block of code runs: one measurement for evaluation and the benchmarks.

    with PeakMemory("cpu") as memory:
        model(ids)
    memory.start_mb, memory.peak_mb, memory.added_mb

- CUDA: the caching allocator's peak (`max_memory_allocated`), reset on entry.
- Linux CPU: the kernel's resident-set high-water mark (VmHWM), reset to the current resident set
  on entry through /proc/self/clear_refs. Exact: no sampling interval to miss a short spike.
- Elsewhere (or where clear_refs is not writable): the resident set sampled every 10 ms.

On the CPU the numbers are the whole process's resident memory, model weights included; freed heap
is handed back to the OS on entry (malloc_trim), so one block's peak does not leak into the next.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def rss_mb() -> float:
    """The process's resident set now, MiB."""
    if sys.platform.startswith("linux"):
        return _status_mb("VmRSS")
    import psutil  # ships with accelerate

    return psutil.Process().memory_info().rss / 2 ** 20


def _clear_refs_works() -> bool:
    return sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK)


class PeakMemory:
    """Context manager: start_mb (on entry), peak_mb (highest during the block), added_mb (their difference).
    `kind` is "cuda_allocated" or "rss"; `method` says how the peak was taken."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.kind = "cuda_allocated" if self.cuda else "rss"
        self.hwm = not self.cuda and _clear_refs_works()
        self.method = ("cuda max_memory_allocated" if self.cuda else
                       "VmHWM after clear_refs" if self.hwm else "RSS sampled every 10 ms")
        self.start_mb = self.peak_mb = 0.0
        self._stop = self._thread = None

    @property
    def added_mb(self) -> float:
        return self.peak_mb - self.start_mb

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_mb = self.peak_mb = torch.cuda.memory_allocated() / 2 ** 20
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        if self.hwm:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        self.start_mb = self.peak_mb = rss_mb()
        if not self.hwm:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak_mb = max(self.peak_mb, rss_mb())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_mb = torch.cuda.max_memory_allocated() / 2 ** 20
        elif self.hwm:
            self.peak_mb = max(self.start_mb, _status_mb("VmHWM"))
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, rss_mb())
