"""The front end's handle on the engine process: start it, send requests, route its outputs,
and restart it when it dies.

Each request gets an asyncio queue; a reader task drains the engine's output socket and puts every
delta (new token ids of one completion), completion record or error on its request's queue.

When the engine process dies (SIGKILL, OOM, a crash), the policy is:
  1. The reader notices within ~0.2 s (the process has exited; it polls the process each time
     the socket is quiet). Requests in flight fail with a 500 error naming the death.
  2. The client is marked not ready: GET /ready answers 503, and new generation requests get a
     503 OpenAI error saying the engine died and is restarting (`outage`); /health stays 200.
  3. `supervise` starts a new engine process (fresh sockets, so nothing queued for the dead one
     leaks into the new one) after a backoff of 0.5, 1, 2 s: at most 3 restarts within 300 s
     (`procs.RestartPolicy`). A restart that fails to come up counts as another death.
  4. When the new engine says ready, /ready is 200 again and requests are served as before.
  5. When the budget is spent, `supervise` returns why; the server logs one line, answers /health
     with 503 (for ~1 s) and exits 1, so that a supervisor (systemd, Kubernetes) restarts it.
The first start is not retried: a model that cannot load fails `strata serve` at once (exit 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import zmq
import zmq.asyncio

from strata.errors import StrataError
from strata.protocol.stats import EngineStats
from strata.protocol.wire import decode, encode
from strata.server import procs

logger = logging.getLogger(__name__)


def restart_policy() -> procs.RestartPolicy:
    """The engine's budget: 3 restarts within 300 s, after 0.5, 1 and 2 s."""
    return procs.RestartPolicy(max_restarts=3, window=300.0, backoff=0.5)


POLL_MS = 200  # how long the reader waits on a quiet socket before checking the process


class EngineDied(procs.ChildUnavailable):
    pass


class EngineClient:
    def __init__(self, engine_kwargs: dict, ipc: procs.IpcDir, cpus: list[int] | None) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.sync_ctx = zmq.Context.shadow(self.ctx.underlying)  # sends never wait: see _send
        self.ipc = ipc
        cpu_arg = ["--cpus", ",".join(map(str, cpus))] if cpus else []
        self._args = ["--config", json.dumps(engine_kwargs), "--log-level",
                      logging.getLevelName(logging.getLogger("strata").getEffectiveLevel()), *cpu_arg]
        self.push: zmq.Socket | None = None
        self.pull: zmq.asyncio.Socket | None = None
        self.proc = None  # the current engine process (subprocess.Popen)
        self.starts = 0  # engine processes started so far
        self.ready = False  # the current process said ready and has not died
        self.outage: str | None = None  # while set: why new requests get 503
        self.info: dict = {}
        self.stats = EngineStats()
        self.queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._died = asyncio.Event()
        self.on_stats = None  # callable(EngineStats) -> None, set by the metrics layer
        self.on_done = None  # callable(done record) -> None: every finished request's engine timeline

    def _spawn(self) -> None:
        """A new engine process on fresh sockets (the old ones may hold messages for a dead one)."""
        self._close_sockets()
        n = self.starts
        self.starts += 1
        self.push = self.sync_ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)  # never drop or block while an engine is connected
        self.push.bind(self.ipc.address(f"engine-in-{n}"))
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.ipc.address(f"engine-out-{n}"))
        self.proc = procs.spawn("strata.server.engine_proc", "--inbox", self.ipc.address(f"engine-in-{n}"),
                                "--outbox", self.ipc.address(f"engine-out-{n}"), "--start-number", str(n),
                                *self._args)

    async def start(self, timeout: float) -> dict:
        """Start an engine process and wait for its ready message (model loaded and warmed up)."""
        self._spawn()
        deadline = time.monotonic() + timeout
        while True:
            if await self.pull.poll(POLL_MS):
                msg = decode(await self.pull.recv())
                if msg["op"] == "ready":
                    self.info = msg["info"]
                    break
                if msg["op"] == "fatal":
                    raise StrataError(f"engine failed to start: {msg['message']}")
            if self.proc.poll() is not None:
                raise StrataError(f"engine process exited during start-up ({procs.describe_exit(self.proc.returncode)})")
            if time.monotonic() > deadline:
                raise StrataError(f"engine not ready after {timeout:.0f}s")
        self.ready, self.outage = True, None
        self._died.clear()
        self._reader = asyncio.create_task(self._read())
        return self.info

    async def _read(self) -> None:
        proc, pull = self.proc, self.pull
        while True:
            if not await pull.poll(POLL_MS):
                if proc.poll() is not None:
                    break
                continue
            try:
                self._route(decode(await pull.recv()))
            except Exception:
                logger.exception("bad message from the engine ignored")
        how = procs.describe_exit(proc.returncode)
        self.ready = False
        self.outage = f"the engine process died ({how}) and is being restarted; retry when GET /ready returns 200"
        self._fail_all(f"the engine process died ({how}) while running this request")
        self.queues.clear()
        self._died.set()

    def _route(self, msg: dict) -> None:
        if msg.get("op") != "step":
            return
        for d in msg["deltas"]:
            self._put(d["id"], ("delta", d))
        for d in msg["done"]:
            self._put(d["id"], ("done", d))
            if self.on_done is not None:
                self.on_done(d)
        for e in msg["errors"]:
            self._put(e["id"], ("error", e))
        self.stats = EngineStats(**msg["stats"])
        if self.on_stats is not None:
            self.on_stats(self.stats)

    async def supervise(self, timeout: float, policy: procs.RestartPolicy | None = None) -> str:
        """Restart the engine each time it dies, within `policy`; returns why it gave up."""
        policy = policy or restart_policy()
        while True:
            await self._died.wait()
            why = procs.describe_exit(self.proc.returncode)
            logger.error("engine process died (%s)", why)
            failure = None
            while True:
                delay = policy.next_delay()
                if delay is None:
                    return (f"the engine process died ({why}) and {policy.max_restarts} restarts within "
                            f"{policy.window:.0f}s failed (last: {failure}); giving up")
                k = policy.used
                self.outage = (f"the engine process died ({why}) and is restarting (restart {k} of "
                               f"{policy.max_restarts}); retry when GET /ready returns 200")
                logger.warning("restarting the engine in %.1fs (restart %d of %d within %.0fs)", delay, k,
                               policy.max_restarts, policy.window)
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                try:
                    await self.start(timeout)
                except StrataError as e:
                    failure = str(e)
                    logger.error("engine restart %d failed: %s", k, e)
                    continue
                logger.warning("engine restarted: ready again in %.1fs", time.monotonic() - t0)
                break

    def _put(self, rid: str, item: tuple) -> None:
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(item)

    def _fail_all(self, message: str, status: int = 500) -> int:
        if self.queues:
            logger.error("%s: failing %d in-flight requests", message, len(self.queues))
        for q in self.queues.values():
            q.put_nowait(("error", {"message": message, "status": status}))
        return len(self.queues)

    def abort_all(self, message: str) -> int:
        """Fail every in-flight request with 503 (their handlers abort them in the engine)."""
        return self._fail_all(message, 503)

    @property
    def alive(self) -> bool:
        """A started engine that is serving (said ready, has not exited)."""
        return self.ready and self.proc is not None and self.proc.poll() is None

    def _send(self, msg: dict) -> bool:
        """Send without ever blocking: False when no engine is connected (dead, restarting)."""
        try:
            self.push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def add(self, rid: str, prompt_ids: list[int], params: dict, q: asyncio.Queue) -> None:
        """Send a request; its deltas, completion record and errors arrive on `q` as (kind, item).

        While the engine is down the request fails at once with a 503 (on `q`, like engine errors)."""
        if self.alive:
            self.queues[rid] = q
            if self._send({"op": "add", "id": rid, "prompt_ids": prompt_ids, "params": params}):
                return
            self.queues.pop(rid, None)
        why = self.outage or "the engine is not running; retry when GET /ready returns 200"
        q.put_nowait(("error", {"message": why, "status": 503}))

    async def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.queues.pop(rid, None)
        if rids and self.alive:
            self._send({"op": "abort", "ids": rids})

    async def finish_seq(self, rid: str, index: int, stop: str) -> None:
        if self.alive:
            self._send({"op": "finish_seq", "id": rid, "index": index, "stop": stop})

    def release(self, rid: str) -> None:
        """The request is over on the front end's side; drop its queue."""
        self.queues.pop(rid, None)

    async def close(self) -> None:
        """Stop the engine: a shutdown message when it is serving, SIGTERM if it is still loading."""
        if self._reader is not None:
            self._reader.cancel()
        if self.alive and self._send({"op": "shutdown"}):
            for _ in range(50):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        self.ready = False
        if self.proc is not None:
            procs.stop([self.proc])
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self.push, self.pull):
            if sock is not None:
                sock.close(linger=0)
        self.push = self.pull = None
