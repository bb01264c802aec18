"""The front end's handle on the engine process: start it, send requests, route its outputs.

Each request gets an asyncio queue; a reader task drains the engine's output socket and puts every
delta (new token ids of one completion), completion record or error on its request's queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from strata.errors import StrataError
from strata.server import procs
from strata.server.protocol import decode, encode

logger = logging.getLogger(__name__)


class EngineDied(StrataError):
    pass


@dataclass
class EngineStats:
    """The engine's latest report (sent with every step, and each second when idle)."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    kv_usage: float = 0.0
    kv_reserved_bytes: int = 0
    kv_owned_bytes: int = 0
    kv_token_bytes: int = 0
    kv_waste_bytes: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_evictions: int = 0
    steps: int = 0
    stage_seconds: dict = field(default_factory=dict)


class EngineClient:
    def __init__(self, engine_kwargs: dict, ipc: procs.IpcDir, cpus: list[int] | None) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(ipc.address("engine-in"))
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(ipc.address("engine-out"))
        cpu_arg = ["--cpus", ",".join(map(str, cpus))] if cpus else []
        self.proc = procs.spawn(
            "strata.server.engine_proc", "--inbox", ipc.address("engine-in"),
            "--outbox", ipc.address("engine-out"), "--config", json.dumps(engine_kwargs),
            "--log-level", logging.getLevelName(logging.getLogger("strata").getEffectiveLevel()), *cpu_arg,
        )
        self.info: dict = {}
        self.stats = EngineStats()
        self.queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self.on_stats = None  # callable(EngineStats) -> None, set by the metrics layer
        self.on_done = None  # callable(done record) -> None: every finished request's engine timeline

    async def start(self, timeout: float) -> dict:
        """Wait for the engine's ready message (model loaded and warmed up)."""
        deadline = time.monotonic() + timeout
        while True:
            if await self.pull.poll(200):
                msg = decode(await self.pull.recv())
                if msg["op"] == "ready":
                    self.info = msg["info"]
                    break
                if msg["op"] == "fatal":
                    raise StrataError(f"engine failed to start: {msg['message']}")
            if self.proc.poll() is not None:
                raise StrataError(f"engine process exited during start-up (code {self.proc.returncode})")
            if time.monotonic() > deadline:
                raise StrataError(f"engine not ready after {timeout:.0f}s")
        self._reader = asyncio.create_task(self._read())
        return self.info

    async def _read(self) -> None:
        while True:
            if not await self.pull.poll(500):
                if self.proc.poll() is not None:
                    self._fail_all(f"engine process exited (code {self.proc.returncode})")
                    return
                continue
            msg = decode(await self.pull.recv())
            if msg.get("op") != "step":
                continue
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

    def _put(self, rid: str, item: tuple) -> None:
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(item)

    def _fail_all(self, message: str, status: int = 500) -> int:
        logger.error("%s: failing %d in-flight requests", message, len(self.queues))
        for q in self.queues.values():
            q.put_nowait(("error", {"message": message, "status": status}))
        return len(self.queues)

    def abort_all(self, message: str) -> int:
        """Fail every in-flight request with 503 (their handlers abort them in the engine)."""
        return self._fail_all(message, 503)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    async def add(self, rid: str, prompt_ids: list[int], params: dict, q: asyncio.Queue) -> None:
        """Send a request; its deltas, completion record and errors arrive on `q` as (kind, item)."""
        if not self.alive:
            raise EngineDied(f"engine process exited (code {self.proc.returncode}); restart the server")
        self.queues[rid] = q
        await self.push.send(encode({"op": "add", "id": rid, "prompt_ids": prompt_ids, "params": params}))

    async def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.queues.pop(rid, None)
        if rids and self.alive:
            await self.push.send(encode({"op": "abort", "ids": rids}))

    async def finish_seq(self, rid: str, index: int, stop: str) -> None:
        if self.alive:
            await self.push.send(encode({"op": "finish_seq", "id": rid, "index": index, "stop": stop}))

    def release(self, rid: str) -> None:
        """The request is over on the front end's side; drop its queue."""
        self.queues.pop(rid, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.alive:
            await self.push.send(encode({"op": "shutdown"}))
            for _ in range(50):
                if not self.alive:
                    break
                await asyncio.sleep(0.1)
        procs.stop([self.proc])
        self.push.close(linger=0)
        self.pull.close(linger=0)
