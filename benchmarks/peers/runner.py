"""Running things: the run context (commands, logs, command list), servers, the strata command."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .monitor import CpuMonitor
from .settings import REPO, Workload


class StepError(RuntimeError):
    pass


@dataclass
class Ctx:
    args: argparse.Namespace
    wl: Workload
    cache: Path
    run_dir: Path
    results: dict[str, Any]
    python: str = sys.executable
    strata: list[str] = field(default_factory=list)
    llama_dir: Path | None = None
    bin_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    n_cmd: int = 0
    monitor: CpuMonitor | None = None
    last: dict = field(default_factory=dict)  # the record of the latest command run
    waited_total: float = 0.0  # seconds spent in quiet() so far

    def quiet(self, what: str) -> dict:
        """Before a measurement: wait for the other processes to go quiet (bounded); returns the wait."""
        budget = min(self.args.wait_quiet, self.args.wait_quiet_total - self.waited_total)
        if self.monitor is None or budget <= 0:
            return {}
        waited = self.monitor.wait_quiet(self.args.quiet_cpu, budget)
        self.waited_total += waited
        if waited >= 1:
            print(f"    waited {waited:.0f} s for other processes to go quiet before {what}", flush=True)
        return {"waited_quiet_s": round(waited, 1)}

    def display(self, cmd: list[str]) -> str:
        """The command as the report shows it: cache paths as $PEERS/$RUN, the venv's strata as strata."""
        text = shlex.join([str(c) for c in cmd])
        reps = [(str(self.run_dir), "$RUN"), (str(self.cache), "$PEERS")]
        if self.strata:
            reps.insert(0, (shlex.join(self.strata), "strata"))
        reps += [(self.python, "python"), (str(REPO) + "/", ""), (str(Path.home()), "~")]
        for a, b in reps:
            text = text.replace(a, b)
        return text

    def log_path(self, name: str) -> Path:
        self.n_cmd += 1
        return self.run_dir / "logs" / f"{self.n_cmd:02d}-{name}.log"

    def run(self, part: str, name: str, cmd: list[str], timeout: float = 3600, record: bool = True,
            capture: bool = False, cwd: Path | None = None, env: dict | None = None) -> str:
        """Run cmd (stdout+stderr to a log); return stdout when capture (stderr still logged)."""
        log = self.log_path(name)
        shown = self.display(cmd)
        entry: dict[str, Any] = {"part": part, "cmd": shown}
        self.last = entry
        if record:
            self.results["commands"].append(entry)
            if part not in ("prepare", "machine"):
                entry.update(self.quiet(name))
        print(f"[{time.strftime('%H:%M:%S')}] $ {shown}\n    log: {log}", flush=True)
        full_env = {**os.environ, **self.env, **(env or {})}
        wall0 = time.time()
        t0 = time.perf_counter()
        out_path = log.with_suffix(".stdout")
        with open(log, "w") as f:
            f.write(f"$ {shlex.join([str(c) for c in cmd])}\n\n")
            f.flush()
            out_f = open(out_path, "w") if capture else f  # stdout to a file: no pipe to drain
            try:
                rc, peak = run_measured([str(c) for c in cmd], out_f, f, timeout, cwd, full_env,
                                         rss=part not in ("prepare", "machine"))
            finally:
                if capture:
                    out_f.close()
        dt_s = time.perf_counter() - t0
        entry["seconds"] = round(dt_s, 1)
        if peak:
            entry["peak_rss_bytes"] = peak
        if self.monitor is not None:
            entry.update(self.monitor.window(wall0, time.time()))
            busy = entry.get("others_cpu_mean")
            if busy is not None and busy >= self.args.quiet_cpu:
                print(f"    note: other processes used {busy:.0f}% of a core on average meanwhile "
                      f"({'; '.join(entry['busiest'][:2])})", flush=True)
        stdout = ""
        if capture:
            stdout = out_path.read_text(errors="replace")
            out_path.unlink(missing_ok=True)
            with open(log, "a") as f:
                f.write("\n--- stdout ---\n" + stdout)
        status = "ok" if rc == 0 else f"FAILED rc={rc}"
        rss = f", peak RSS {peak / 2**30:.2f} GiB" if peak else ""
        print(f"    {status} in {dt_s:.1f} s{rss}", flush=True)
        if rc != 0:
            raise StepError(f"`{shown}` failed (rc {rc}); last lines of {log}:\n{tail(log)}")
        return stdout


GNU_TIME = "/usr/bin/time"


def run_measured(cmd: list[str], stdout: Any, stderr: Any, timeout: float, cwd: Path | None = None,
                 env: dict | None = None, rss: bool = True) -> tuple[int, int | None]:
    """Run cmd to completion: (exit status, peak resident set size in bytes, or None when not measured).

    The peak is "Maximum resident set size" of GNU time (`/usr/bin/time -f %M`, what `time -v`
    prints; the kernel's ru_maxrss of the command, which time forks from its own small process: a
    child of this Python process would count this process's RSS too, which exec inherits into
    ru_maxrss). Without GNU time, the command's process tree is sampled with psutil every 50 ms.
    The command gets a session of its own; on timeout (or Ctrl-C) that process group is killed and
    subprocess.TimeoutExpired raised, as subprocess.run does.
    """
    import tempfile
    import threading

    rss_file = None
    if rss and os.access(GNU_TIME, os.X_OK):
        fd, rss_file = tempfile.mkstemp(prefix="peers-rss-", suffix=".txt")
        os.close(fd)
        cmd = [GNU_TIME, "-f", "%M", "-o", rss_file, *cmd]
    p = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=cwd, env=env, start_new_session=True)
    sampled = [0]
    done = threading.Event()

    def sample() -> None:
        import psutil

        try:
            root = psutil.Process(p.pid)
        except psutil.Error:
            return
        while not done.wait(0.05):
            try:
                procs = [root, *root.children(recursive=True)]
                sampled[0] = max(sampled[0], sum(q.memory_info().rss for q in procs if q.is_running()))
            except psutil.Error:
                continue

    sampler = threading.Thread(target=sample, daemon=True) if rss and rss_file is None else None
    if sampler:
        sampler.start()

    def stop() -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        done.set()

    try:
        rc = p.wait(timeout)
        peak = sampled[0] or None
        if rss_file:
            peak = parse_time_rss(Path(rss_file).read_text(errors="replace"))
    except BaseException:  # a timeout, or Ctrl-C: its own session would keep the command running
        stop()
        raise
    finally:
        done.set()
        if sampler:
            sampler.join(5)
        if rss_file:
            Path(rss_file).unlink(missing_ok=True)
    return rc, peak


def parse_time_rss(text: str) -> int | None:
    """Bytes from GNU time's `-f %M` output file (KiB on the last line; a line such as "Command
    exited with non-zero status 1" may come first), or None."""
    for line in reversed(text.strip().splitlines()):
        if line.strip().isdigit():
            return int(line.strip()) * 1024 or None
    return None


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def free_port(start: int) -> int:
    for port in range(start, start + 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise StepError(f"no free TCP port in {start}..{start + 199}")


class Server:
    """A server process started by us (own session), ready when GET ready_path answers 200."""

    def __init__(self, ctx: Ctx, part: str, name: str, cmd: list[str], port: int, ready_path: str,
                 timeout_s: float = 600):
        self.ctx, self.part, self.name, self.cmd = ctx, part, name, cmd
        self.port, self.ready_path, self.timeout_s = port, ready_path, timeout_s
        self.proc: subprocess.Popen | None = None
        self.log = ctx.log_path(name)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        shown = self.ctx.display(self.cmd)
        self.ctx.results["commands"].append({"part": self.part, "cmd": shown + " &"})
        print(f"[{time.strftime('%H:%M:%S')}] $ {shown} &\n    log: {self.log}", flush=True)
        self._f = open(self.log, "w")
        self.proc = subprocess.Popen([str(c) for c in self.cmd], stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.ctx.env})
        t0 = time.perf_counter()
        while True:
            if self.proc.poll() is not None:
                self._f.close()
                raise StepError(f"{self.name} exited (rc {self.proc.returncode}) before it was ready:\n"
                                f"{tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.perf_counter() - t0 > self.timeout_s:
                self.__exit__(None, None, None)
                raise StepError(f"{self.name} not ready after {self.timeout_s:.0f} s:\n{tail(self.log)}")
            time.sleep(0.5)
        print(f"    ready in {time.perf_counter() - t0:.1f} s at {self.url}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            self._f.close()
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)  # the session we started: the server and its children
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        except ProcessLookupError:
            pass
        self._f.close()
        time.sleep(1.0)


def strata_cmd(python: str) -> list[str]:
    exe = Path(python).parent / "strata"
    return [str(exe)] if exe.is_file() else [python, "-c", "import sys; from strata.cli import main; sys.exit(main())"]
