"""What a training run reports: a JSONL line per logged step (metrics.jsonl), the same scalars to
TensorBoard (runs in OUT/tensorboard), a progress bar, and the stability guards' findings."""

from __future__ import annotations

import json
import logging
import math
import resource
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def peak_memory_bytes(device: str) -> int:
    """Peak memory of this process so far: CUDA's allocator peak, else the peak resident set.

    Linux's VmHWM (this address space's high-water mark) where there is one: ru_maxrss survives
    exec, so a process forked from a bigger one (a test run, `strata plan --measure`'s caller)
    would report its parent's size."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return vm_hwm_bytes()


def vm_hwm_bytes() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class SpikeDetector:
    """A loss above factor x the median of the last `window` losses is a spike (reported, counted)."""

    def __init__(self, factor: float, window: int = 50, warmup: int = 10) -> None:
        self.factor, self.warmup = factor, warmup
        self.recent: deque[float] = deque(maxlen=window)
        self.count = 0

    def check(self, loss: float) -> float | None:
        """The running median when `loss` spikes over it, else None."""
        median = statistics.median(self.recent) if len(self.recent) >= self.warmup else None
        self.recent.append(loss)
        if median is not None and loss > self.factor * median:
            self.count += 1
            return median
        return None


class MetricsSink:
    """Rank 0 writes; other ranks hold a sink that does nothing."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.writer = None
        self.jsonl = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # the tensorboard package is a dependency; be clear if it is gone
                logger.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
            else:
                self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in values.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
