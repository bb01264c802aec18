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

LoRA adapters: the front end's registry (server/lora.py) is replayed into every engine process
before it takes requests: at the first start an adapter that fails fails `strata serve` (naming
it); after a restart it is dropped from the registry with an error in the log (the rest serve).
Loading and unloading are calls with a reply (`call`): the engine reads the adapter on a worker
thread and keeps stepping meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time

import zmq
import zmq.asyncio

from strata.errors import RequestError, StrataError
from strata.protocol.lora import LoRAError, LoRARequest
from strata.protocol.stats import EngineStats
from strata.protocol.wire import decode, encode
from strata.server import procs
from strata.server.lora import LoRARegistry

logger = logging.getLogger(__name__)


def restart_policy() -> procs.RestartPolicy:
    """The engine's budget: 3 restarts within 300 s, after 0.5, 1 and 2 s."""
    return procs.RestartPolicy(max_restarts=3, window=300.0, backoff=0.5)


POLL_MS = 200  # how long the reader waits on a quiet socket before checking the process


class EngineDied(procs.ChildUnavailable):
    pass


class EngineRefused(RequestError):
    """The engine answered a call with an error: `status` is its HTTP status (400: the input)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def lora_wire(lora: LoRARequest) -> dict:
    return dataclasses.asdict(lora)


class EngineClient:
    def __init__(self, engine_kwargs: dict, ipc: procs.IpcDir, cpus: list[int] | None,
                 loras: LoRARegistry | None = None, call_timeout: float = 600.0) -> None:
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
        self.loras = loras if loras is not None else LoRARegistry()  # replayed into each engine process
        self.call_timeout = call_timeout  # seconds a call (an adapter load) may take
        self._calls: dict[int, asyncio.Future] = {}  # call token -> its reply
        self._tokens = itertools.count(1)

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
        self._died.clear()
        self._reader = asyncio.create_task(self._read())
        try:
            await self._replay_loras(first=self.starts == 1)
        except BaseException:  # this engine cannot serve: stopped, so a retry starts clean
            self._reader.cancel()
            procs.stop([self.proc])
            raise
        self.ready, self.outage = True, None
        return self.info

    async def _replay_loras(self, first: bool) -> None:
        """Add the registry's adapters to the new engine, before it takes any request."""
        for lora in sorted(self.loras.adapters.values(), key=lambda lr: lr.lora_int_id):
            try:
                await self.load_lora(lora)
            except EngineDied as e:
                raise StrataError(f"the engine process died while adding LoRA adapter {lora.lora_name}: {e}") from None
            except RequestError as e:
                if first:
                    raise StrataError(f"LoRA adapter {lora.lora_name} ({lora.path}) cannot be served: {e}") from None
                self.loras.remove(lora.lora_name)
                logger.error("LoRA adapter %s could not be added to the restarted engine (%s); it is no longer "
                             "served (load it again once fixed)", lora.lora_name, e)

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
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(EngineDied(f"the engine process died ({how}) before it answered; retry when "
                                             "GET /ready returns 200"))
        self._died.set()

    def _route(self, msg: dict) -> None:
        if msg.get("op") == "reply":
            fut = self._calls.pop(msg["token"], None)
            if fut is not None and not fut.done():
                if msg.get("error") is not None:
                    fut.set_exception(EngineRefused(msg["error"], msg.get("status", 400)))
                else:
                    fut.set_result(msg.get("result"))
            return
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

    async def add(self, rid: str, prompt_ids: list[int], params: dict, q: asyncio.Queue,
                  lora: LoRARequest | None = None) -> None:
        """Send a request; its deltas, completion record and errors arrive on `q` as (kind, item).

        While the engine is down the request fails at once with a 503 (on `q`, like engine errors);
        a request whose adapter was unloaded since it was routed fails with a 404."""
        if lora is not None and not self.loras.holds(lora):
            q.put_nowait(("error", {"message": f"LoRA adapter {lora.lora_name!r} was unloaded before this request "
                                    "reached the engine (GET /v1/models lists the served names)", "status": 404}))
            return
        if self.alive:
            self.queues[rid] = q
            msg = {"op": "add", "id": rid, "prompt_ids": prompt_ids, "params": params}
            if lora is not None:
                msg["lora"] = lora_wire(lora)
            if self._send(msg):
                return
            self.queues.pop(rid, None)
        why = self.outage or "the engine is not running; retry when GET /ready returns 200"
        q.put_nowait(("error", {"message": why, "status": 503}))

    async def call(self, msg: dict, timeout: float | None = None):
        """Send `msg` with a token and wait for the engine's reply: its result, EngineRefused for an
        error it answered, EngineDied when it dies first (or is not running)."""
        if self.push is None or self.proc is None or self.proc.poll() is not None:
            raise EngineDied(self.outage or "the engine is not running; retry when GET /ready returns 200")
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._calls[token] = fut
        if not self._send({**msg, "token": token}):
            self._calls.pop(token, None)
            raise EngineDied(self.outage or "the engine is not running; retry when GET /ready returns 200")
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout or self.call_timeout)
        except asyncio.TimeoutError:
            raise StrataError(f"the engine did not answer {msg['op']} within {timeout or self.call_timeout:.0f}s") from None
        finally:
            self._calls.pop(token, None)

    async def load_lora(self, lora: LoRARequest) -> None:
        """Have the engine read and check the adapter (LoRAError naming the problem if it cannot)."""
        try:
            await self.call({"op": "load_lora", "lora": lora_wire(lora)})
        except EngineRefused as e:
            if e.status >= 500:
                raise
            raise LoRAError(str(e)) from None

    async def unload_lora(self, lora: LoRARequest) -> bool:
        """Refuse the adapter to new requests in the engine (running ones finish); False if unknown there."""
        return bool(await self.call({"op": "unload_lora", "id": lora.lora_int_id}))

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
