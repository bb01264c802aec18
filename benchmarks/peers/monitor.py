"""Load on the shared machine: the load average and the CPU used by processes outside this run."""

from __future__ import annotations

import os
import time
from typing import Any


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class CpuMonitor:
    """Samples, every `period` s, the CPU used by processes outside this run's process tree.

    The machine is shared: figures taken while someone else's job held a core are not comparable,
    so every measured command records the mean/max CPU of the others during it (in % of one core),
    and `wait_quiet` holds a measurement back (up to a limit) until the others go quiet.
    """

    def __init__(self, period: float = 2.0):
        import threading

        import psutil

        self.psutil, self.period = psutil, period
        self.samples: list[tuple[float, float, list[str]]] = []  # (time, others' CPU %, busiest)
        self._procs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _mine(self) -> set[int]:
        me = self.psutil.Process()
        try:
            return {me.pid} | {c.pid for c in me.children(recursive=True)}
        except self.psutil.Error:
            return {me.pid}

    def _sample(self) -> None:
        mine, total, busy = self._mine(), 0.0, []
        seen = set()
        for p in self.psutil.process_iter(["pid"]):
            pid = p.pid
            seen.add(pid)
            proc = self._procs.setdefault(pid, p)
            try:
                pct = proc.cpu_percent(None)  # since this object's previous call (0.0 the first time)
                if pid in mine or pct < 1.0:
                    continue
                total += pct
                if pct >= 10:
                    busy.append((pct, " ".join(proc.cmdline())[:80] or proc.name()))
            except self.psutil.Error:
                continue
        for pid in set(self._procs) - seen:
            del self._procs[pid]
        busy.sort(reverse=True)
        self.samples.append((time.time(), total, [f"{c:.0f}% {n}" for c, n in busy[:3]]))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._sample()
            except Exception:  # never let the monitor kill the run
                pass

    def window(self, t0: float, t1: float) -> dict:
        """Others' CPU (% of one core) between two time.time() stamps."""
        xs = [s for s in self.samples if t0 <= s[0] <= t1]
        if not xs:
            return {"others_cpu_mean": None, "others_cpu_max": None, "busiest": []}
        top = max(xs, key=lambda s: s[1])
        return {"others_cpu_mean": round(sum(s[1] for s in xs) / len(xs), 1),
                "others_cpu_max": round(top[1], 1), "busiest": top[2]}

    def wait_quiet(self, threshold: float, max_wait: float) -> float:
        """Wait until the others' CPU over the last ~6 s is below threshold, at most max_wait s."""
        t0 = time.time()
        while time.time() - t0 < max_wait:
            recent = [s[1] for s in self.samples if s[0] >= time.time() - 3 * self.period - 0.5]
            if len(recent) >= 3 and sum(recent) / len(recent) < threshold:
                break
            time.sleep(self.period)
        return time.time() - t0

    def stop(self) -> None:
        self._stop.set()
