"""The run's log: an accelerate tracker that appends one JSON object per line to run/log.jsonl; the other trackers
(output.trackers) checked before a run starts.

    {"event": "config", "engine": {"name": "deepspeed", "stage": 3, "world": 2, ...}, "config": {"train.lr": 3e-4, ...}}
    {"step": 10, "loss": 2.31, "lr": 0.0003, "seq_len": 64, "tokens": 5120, "tokens_per_s": 41000.0, ...}
    {"step": 20, "eval/loss@64": 2.2}

Lines are flushed as written, so a killed run leaves a readable log; a resumed run appends (steps
after the checkpoint appear again: readers keep the last line per step, as `read_log` does).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from accelerate.tracking import GeneralTracker

from ..errors import RetrofitError, read_utf8
from ..recipe.sections import TRACKERS


def check_trackers(names) -> list[str]:
    """output.trackers, each one accelerate can import here; a missing package is one line naming it (accelerate
    itself would drop that tracker and log nothing to it, silently)."""
    from accelerate.tracking import get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    for name in names:
        if name not in available:
            raise RetrofitError(f"output.trackers has {name} but it is not installed: pip install {TRACKERS[name]}")
    return list(names)

ENGINE_KEY = "engine"  # in init_trackers' config: the engine that runs (train/engine.py), written beside the config


class JsonlTracker(GeneralTracker):
    name = "jsonl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)
        self.file = None

    @property
    def tracker(self):
        return self.file

    def start(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")

    def _write(self, record: dict) -> None:
        if self.file is None:
            self.start()
        self.file.write(json.dumps(record, default=str) + "\n")
        self.file.flush()

    def store_init_configuration(self, values: dict):
        config = {k: v for k, v in values.items() if k != ENGINE_KEY}
        engine = values.get(ENGINE_KEY)  # JSON text (train/loop.py), so that every tracker takes it
        self._write({"event": "config", "time": time.time(), ENGINE_KEY: json.loads(engine) if isinstance(engine, str)
                     else engine, "config": config})

    def log(self, values: dict, step: int | None = None, **kwargs):
        self._write({"step": step, **{k: _plain(v) for k, v in values.items()}})

    def finish(self):
        if self.file is not None:
            self.file.close()
            self.file = None


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_log(path) -> list[dict]:
    """Step records of a log.jsonl, last one per (step, kind) wins (a resumed run re-logs some steps)."""
    latest: dict[tuple, dict] = {}
    for line in read_utf8(path).splitlines():  # not UTF-8: a line naming the file
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if not isinstance(record, dict) or record.get("step") is None:
            continue
        kind = "eval" if any(k.startswith("eval/") for k in record) else "train"
        latest[(record["step"], kind)] = record
    return [latest[k] for k in sorted(latest)]
