"""One API request in flight on the front end.

It sends one engine request per prompt, turns the engine's token-id deltas into text deltas per
choice (detokenisation and stop strings happen here, in the front-end process, off the engine's
loop), tells the engine to stop a choice whose stop string appeared, aborts everything if the
client goes away, and records the request's timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from strata.protocol.lora import LoRARequest
from strata.protocol.output_text import OutputText
from strata.protocol.sampling_params import SamplingParams
from strata.protocol.wire import params_to_dict


class EngineRequestFailed(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ChoiceDelta:
    """New output of one choice since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first delta only, when asked for


@dataclass
class _Choice:
    index: int
    prompt_index: int
    output: OutputText
    shown: int = 0  # chars of output.text already returned
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None


@dataclass
class Generation:
    server: object  # server.state.ServerState
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    arrival: float
    tokenize_seconds: float = 0.0
    first_token_time: float | None = None
    choices: dict[tuple[int, int], _Choice] = field(default_factory=dict)  # (prompt, seq index)
    detokenize_seconds: float = 0.0
    engine_suffix: str = ""  # keeps engine ids unique when clients reuse an X-Request-Id
    lora: LoRARequest | None = None  # the adapter the request's `model` named
    model_name: str = ""  # the `model` responses carry: the adapter's name, else the primary served name

    def engine_id(self, p: int) -> str:
        return f"{self.request_id}{self.engine_suffix}-{p}"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    @property
    def finished(self) -> bool:
        n = len(self.prompts) * self.params.n
        return len(self.choices) == n and all(c.finish_reason for c in self.choices.values())

    async def stream(self) -> AsyncIterator[ChoiceDelta]:
        """Yield text deltas as the engine produces tokens; aborts the engine's work if cancelled."""
        engine = self.server.engine
        queue: asyncio.Queue = asyncio.Queue()
        ids = [self.engine_id(p) for p in range(len(self.prompts))]
        by_id = {rid: p for p, rid in enumerate(ids)}
        payload = params_to_dict(self.params)
        adapter = {"lora": self.lora} if self.lora is not None else {}
        try:
            for rid, prompt in zip(ids, self.prompts):
                await engine.add(rid, prompt, payload, queue, **adapter)
            while not self.finished:
                kind, item = await queue.get()
                if kind == "error":
                    raise EngineRequestFailed(item["message"], item.get("status", 500))
                if kind == "delta":
                    delta = await self._on_delta(by_id[item["id"]], item)
                    if delta is not None:
                        yield delta
        finally:
            unfinished = [self.engine_id(p) for p in range(len(self.prompts))
                          if not self._prompt_finished(p)]
            for rid in ids:
                engine.release(rid)
            if unfinished:
                await engine.abort(unfinished)

    def _prompt_finished(self, p: int) -> bool:
        mine = [c for (pi, _), c in self.choices.items() if pi == p]
        return len(mine) == self.params.n and all(c.finish_reason for c in mine)

    async def _on_delta(self, p: int, d: dict) -> ChoiceDelta | None:
        key = (p, d["index"])
        choice = self.choices.get(key)
        if choice is None:
            output = OutputText(self.server.tokenizer, self.prompts[p], self.params)
            choice = self.choices[key] = _Choice(p * self.params.n + d["index"], p, output)
        if choice.finish_reason is not None:
            return None  # the engine ran past a stop string we already found
        now = time.time()
        if self.first_token_time is None and d["tokens"]:
            self.first_token_time = now
        metrics = self.server.metrics
        if choice.last_token_time is not None and d["tokens"]:
            metrics.itl.observe(now - choice.last_token_time)
        if d["tokens"]:
            choice.last_token_time = now
        t0 = time.perf_counter()
        tokens, lps = d["tokens"], d["logprobs"]
        kept, finish, stop_reason = [], d["finish"], d["stop_reason"]
        for i, tok in enumerate(tokens):
            choice.num_tokens += 1
            kept.append(tok)
            last = i == len(tokens) - 1
            stop = choice.output.add(tok, choice.num_tokens, finishing=last and finish is not None)
            if stop is not None:
                finish, stop_reason = "stop", stop
                if d["finish"] is None:
                    await self.server.engine.finish_seq(self.engine_id(p), d["index"], stop)
                break
        self.detokenize_seconds += time.perf_counter() - t0
        text = choice.output.text[choice.shown:]
        choice.shown = len(choice.output.text)
        choice.finish_reason, choice.stop_reason = finish, stop_reason
        logprobs = None
        if lps is not None:
            logprobs = [{int(t): float(v) for t, v in pairs} for pairs in lps[: len(kept)]]
        prompt_lps = None
        if d.get("prompt_logprobs") is not None:
            prompt_lps = [None if e is None else {int(t): float(v) for t, v in e} for e in d["prompt_logprobs"]]
        if not text and not kept and finish is None and prompt_lps is None:
            return None
        return ChoiceDelta(choice.index, text, kept, logprobs, finish, stop_reason, prompt_lps)

