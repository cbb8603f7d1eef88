"""Other libraries' log records that retrofit drops: one, DeepSpeed's CPU fallback notice (issue 62).

    import retrofit          # installs the filter (retrofit/__init__.py), as does `retrofit ...` (cli.py)

No import but the standard library's logging: the package root calls this on `import retrofit`, which must stay
fast (no torch, no transformers).
"""

from __future__ import annotations

import logging

CPU_FALLBACK = "Setting accelerator to CPU"  # deepspeed/accelerator/real_accelerator.py, logged with no args


class CpuFallbackNotice(logging.Filter):
    """DeepSpeed, when installed, is imported by transformers -> accelerate, and on a machine without an accelerator it
    logs "[WARNING] Setting accelerator to CPU. If you have GPU ..." at every save: on a CPU machine that is the
    expected outcome, not news (issue 62). Only that record is dropped; DeepSpeed's choice is untouched (it still
    picks CPU, and DS_ACCELERATOR still wins), so an undetected GPU fails loudly elsewhere, as before."""

    retrofit_cpu_notice = True  # the mark install() looks for: a reloaded module's class is another class

    def filter(self, record: logging.LogRecord) -> bool:
        # record.msg, not getMessage(): a filter runs outside logging's error handling, so a record whose
        # arguments do not fit its format would raise in the caller
        return not (isinstance(record.msg, str) and record.msg.startswith(CPU_FALLBACK))


def quiet_deepspeed_cpu_notice() -> None:
    """Before DeepSpeed can be imported: its logger is logging.getLogger("DeepSpeed"), the same object later (its
    LoggerFactory adds a handler and keeps the filters). Idempotent: one filter however often it is called."""
    logger = logging.getLogger("DeepSpeed")
    if not any(getattr(f, "retrofit_cpu_notice", False) for f in logger.filters):
        logger.addFilter(CpuFallbackNotice())
