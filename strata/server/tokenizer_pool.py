"""Tokenisation off the event loop: a supervised pool of worker processes, or in-loop when disabled.

`run(job)` returns token ids and the seconds spent; errors in the text or template come back as
RequestError for that request alone.

Supervision. The pool talks to its workers through one ROUTER socket and picks the worker for each
job (the least busy live one), so it knows which jobs each worker holds. A watcher polls the
worker processes every 0.2 s; when one has exited, its jobs go to a live worker (or wait for one,
at most PENDING_TIMEOUT), a job whose worker died MAX_ATTEMPTS times fails with a 503 (a poison
input cannot take every worker down), and the worker is respawned after a backoff, within a
budget per worker (RESTARTS). `outage` is set while no worker is alive (GET /ready then answers
503 and new generation requests get 503); when every worker has spent its budget, `supervise`
returns why and the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from strata.errors import RequestError, StrataError
from strata.protocol.wire import decode, encode
from strata.server import procs
from strata.server.tokenizer_worker import tokenize

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2  # how often the watcher looks at the worker processes
MAX_ATTEMPTS = 2  # workers a job may outlive before it fails
PENDING_TIMEOUT = 30.0  # seconds a job may wait for a live worker


def restart_policy() -> procs.RestartPolicy:
    """Each worker slot: at most 5 respawns within 60 s, after 0.25, 0.5, 1, 2, 4 s."""
    return procs.RestartPolicy(max_restarts=5, window=60.0, backoff=0.25, max_backoff=4.0)


class InLoopTokenizer:
    """Tokenises in the caller's event loop (`--tokenizer-workers 0`): the baseline the pool beats."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def start(self, timeout: float) -> None:
        return None

    async def run(self, job: dict) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        try:
            ids = tokenize(self.tokenizer, job)
        except StrataError as e:
            raise RequestError(str(e)) from None
        return ids, time.perf_counter() - t0

    def close(self) -> None:
        return None


@dataclass
class _Worker:
    slot: int
    policy: procs.RestartPolicy
    proc: object = None  # subprocess.Popen; None while waiting to be respawned
    ident: bytes = b""
    up: bool = False  # said hello, not seen dead
    jobs: set = field(default_factory=set)
    respawn_at: float = 0.0
    gave_up: bool = False


@dataclass
class _Job:
    payload: bytes
    fut: asyncio.Future
    since: float  # when it last started waiting for a worker
    attempts: int = 0
    worker: _Worker | None = None


class TokenizerPool:
    def __init__(self, model_path: str, num_workers: int, ipc: procs.IpcDir, cpus: list[int] | None,
                 chat_template: str | None = None) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises, never vanishes
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.address = ipc.address("tok")
        self.sock.bind(self.address)
        self._worker_args = ["--model", model_path, "--address", self.address]
        if cpus:
            self._worker_args += ["--cpus", ",".join(map(str, cpus))]
        if chat_template is not None:  # --chat-template: the workers render chat prompts
            self._worker_args += ["--chat-template", chat_template]
        self._spawned = itertools.count()
        self.workers = [_Worker(i, restart_policy()) for i in range(num_workers)]
        for w in self.workers:
            self._spawn(w)
        self._ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._pending: deque[int] = deque()
        self._reader: asyncio.Task | None = None
        self.outage: str | None = None  # while set: why new requests get 503

    def _spawn(self, w: _Worker) -> None:
        ident = f"tok{w.slot}.{next(self._spawned)}"
        w.ident, w.up, w.jobs = ident.encode(), False, set()
        w.proc = procs.spawn("strata.server.tokenizer_worker", *self._worker_args, "--identity", ident)

    def _worker(self, ident: bytes) -> _Worker | None:
        return next((w for w in self.workers if w.ident == ident), None)

    def _live(self) -> list[_Worker]:
        return [w for w in self.workers if w.up and w.proc is not None and w.proc.poll() is None]

    async def start(self, timeout: float) -> None:
        """Wait until every worker has said hello, then route results to their callers."""
        self._reader = asyncio.create_task(self._read())
        deadline = time.monotonic() + timeout
        while not all(w.up for w in self.workers):
            await asyncio.sleep(0.05)
            dead = [w.proc.args for w in self.workers if w.proc.poll() is not None]
            if dead:
                raise StrataError(f"tokenizer worker exited during start-up: {dead[0]}")
            if time.monotonic() > deadline:
                raise StrataError(f"tokenizer workers not up after {timeout:.0f}s")

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                msg = decode(frames[-1])
            except Exception:
                logger.exception("bad message from a tokenizer worker ignored")
                continue
            w = self._worker(frames[0])
            if "hello" in msg:
                if w is not None:
                    w.up = True
                    self.outage = None
                    self._flush()
                continue
            jid = msg.get("job")
            if w is not None:
                w.jobs.discard(jid)
            job = self._jobs.get(jid)
            if job is not None and not job.fut.done():
                job.fut.set_result(msg)

    def _dispatch(self, jid: int) -> None:
        """Send job `jid` to the least busy live worker, or queue it until one is up."""
        job = self._jobs[jid]
        live = self._live()
        while live:
            w = min(live, key=lambda w: len(w.jobs))
            sent = self.sock.send_multipart([w.ident, job.payload], flags=zmq.NOBLOCK)  # a finished future
            if sent.exception() is None:
                w.jobs.add(jid)
                job.worker, job.attempts = w, job.attempts + 1
                return
            live.remove(w)  # not (or no longer) connected: the watcher will see it exit
        job.worker, job.since = None, time.monotonic()
        self._pending.append(jid)

    def _flush(self) -> None:
        pending, self._pending = self._pending, deque()
        for jid in pending:
            if jid in self._jobs:
                self._dispatch(jid)

    async def run(self, job: dict) -> tuple[list[int], float]:
        jid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        entry = self._jobs[jid] = _Job(encode({**job, "job": jid}), fut, time.monotonic())
        try:
            self._dispatch(jid)
            msg = await fut
        finally:
            self._jobs.pop(jid, None)
            if entry.worker is not None:
                entry.worker.jobs.discard(jid)
        if "error" in msg:
            if msg.get("internal"):
                raise RuntimeError(f"tokenizer worker: {msg['error']}")
            raise RequestError(msg["error"])
        return msg["ids"], msg["seconds"]

    # --- supervision ------------------------------------------------------------------------
    async def supervise(self) -> str:
        """Replace dead workers and move their jobs, until every worker slot has given up: why."""
        while True:
            await asyncio.sleep(POLL_SECONDS)
            now = time.monotonic()
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is not None:
                    self._on_death(w, now)
                if w.proc is None and not w.gave_up and now >= w.respawn_at:
                    self._spawn(w)
            self._expire(now)
            if self._live():
                self.outage = None
                if self._pending:
                    self._flush()
            else:
                self.outage = "no tokenizer worker is running (restarting); retry when GET /ready returns 200"
            if all(w.gave_up for w in self.workers):
                self._fail_waiting("every tokenizer worker died and was not restarted")
                return (f"every tokenizer worker died more than {self.workers[0].policy.describe()}; "
                        "giving up")

    def _on_death(self, w: _Worker, now: float) -> None:
        how = procs.describe_exit(w.proc.returncode)
        jobs, w.jobs, w.proc, w.up = sorted(w.jobs), set(), None, False
        delay = w.policy.next_delay()
        if delay is None:
            w.gave_up = True
            logger.error("tokenizer worker %d died (%s) %s; not restarting it", w.slot, how, w.policy.describe())
        else:
            w.respawn_at = now + delay
            logger.warning("tokenizer worker %d died (%s) holding %d jobs; restarting it (restart %d of %d "
                           "within %.0fs)", w.slot, how, len(jobs), w.policy.used, w.policy.max_restarts,
                           w.policy.window)
        for jid in jobs:
            job = self._jobs.get(jid)
            if job is None or job.fut.done():
                continue
            if job.attempts >= MAX_ATTEMPTS:
                job.fut.set_exception(procs.ChildUnavailable(
                    f"the tokenizer worker died ({how}) while tokenising this request, {job.attempts} times; "
                    "the request was dropped"))
            else:
                self._dispatch(jid)

    def _expire(self, now: float) -> None:
        while self._pending:
            job = self._jobs.get(self._pending[0])
            if job is not None and now - job.since < PENDING_TIMEOUT:
                return
            self._pending.popleft()
            if job is not None and not job.fut.done():
                job.fut.set_exception(procs.ChildUnavailable(
                    f"no tokenizer worker came up within {PENDING_TIMEOUT:.0f}s; retry later"))

    def _fail_waiting(self, why: str) -> None:
        for job in self._jobs.values():
            if not job.fut.done():
                job.fut.set_exception(procs.ChildUnavailable(why))

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        procs.stop([w.proc for w in self.workers if w.proc is not None])
        self.sock.close(linger=0)
