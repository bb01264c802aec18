"""Tokenisation off the event loop: a pool of worker processes, or in-loop when disabled.

`encode_text` / `encode_chat` return token ids and the seconds spent; errors in the text or
template come back as RequestError for that request alone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import zmq
import zmq.asyncio

from strata.errors import RequestError, StrataError
from strata.server import procs
from strata.server.protocol import decode, encode
from strata.server.tokenizer_worker import tokenize

logger = logging.getLogger(__name__)


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


class TokenizerPool:
    def __init__(self, model_path: str, num_workers: int, ipc: procs.IpcDir, cpus: list[int] | None) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.jobs = self.ctx.socket(zmq.PUSH)
        self.jobs.bind(ipc.address("tok-jobs"))
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(ipc.address("tok-results"))
        cpu_arg = ["--cpus", ",".join(map(str, cpus))] if cpus else []
        self.procs = [
            procs.spawn("strata.server.tokenizer_worker", "--model", model_path, "--jobs", ipc.address("tok-jobs"),
                        "--results", ipc.address("tok-results"), "--worker-id", str(i), *cpu_arg)
            for i in range(num_workers)
        ]
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def start(self, timeout: float) -> None:
        """Wait until every worker has said hello, then route results to their callers."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < len(self.procs):
            if await self.results.poll(200):
                seen += "hello" in decode(await self.results.recv())
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                raise StrataError(f"tokenizer worker exited during start-up: {dead[0]}")
            if time.monotonic() > deadline:
                raise StrataError(f"tokenizer workers not up after {timeout:.0f}s")
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = decode(await self.results.recv())
            fut = self._waiting.pop(msg.get("job"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    async def run(self, job: dict) -> tuple[list[int], float]:
        jid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[jid] = fut
        try:
            await self.jobs.send(encode({**job, "job": jid}))
            msg = await fut
        finally:
            self._waiting.pop(jid, None)
        if "error" in msg:
            if msg.get("internal"):
                raise RuntimeError(f"tokenizer worker: {msg['error']}")
            raise RequestError(msg["error"])
        return msg["ids"], msg["seconds"]

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        procs.stop(self.procs)
        self.jobs.close(linger=0)
        self.results.close(linger=0)
