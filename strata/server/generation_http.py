"""The one path a generation request takes once its prompts are built, for chat and completions.

`generate` admits the request (model check, --max-queue), lets the endpoint build its prompts and
sampling parameters, then answers with SSE chunks (`stream_sse`) or one JSON body
(`collect_json`), cancelling the engine's work when the client goes away. What differs between
the endpoints (choice and chunk shapes, delta vs text, logprobs layout) is a `ResponseShape`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.protocol.lora import LoRARequest
from strata.protocol.sampling_params import SamplingParams
from strata.server.generation import ChoiceDelta, EngineRequestFailed, Generation
from strata.server.openai_api import error_response
from strata.server.responses import usage
from strata.server.state import ServerState

logger = logging.getLogger("strata.server")

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class ResponseShape(Protocol):
    """How one endpoint lays out its choices; one instance per request (it may keep per-choice state)."""

    id_prefix: str  # of the request id: "cmpl-", "chatcmpl-"
    object_name: str  # `object` of the non-streaming body

    def chunk(self, rid: str, model: str, created: int, choices: list[dict],
              usage_: dict | None = None) -> dict[str, Any]:
        """One stream chunk around `choices` (empty for the final usage chunk)."""

    def stream_choice(self, d: ChoiceDelta) -> dict:
        """The choice entry of the stream chunk carrying delta `d`."""

    def keep_logprobs(self, d: ChoiceDelta) -> None:
        """Non-streaming: remember `d`'s logprobs for `choice`."""

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        """Non-streaming: the finished choice `index` with all its text."""


@dataclass
class Submission:
    """What an endpoint hands the shared path: prompts ready for the engine and how to answer."""

    prompts: list[list[int]]
    params: SamplingParams
    tokenize_seconds: float
    shape: ResponseShape


def served_names(state: ServerState) -> tuple[str, ...]:
    """Every name `model` may give: the base's served names, then the LoRA adapters'."""
    return (*state.options.model_names, *state.loras.names())


def model_not_found(state: ServerState, name: str) -> JSONResponse:
    served = " or ".join(map(repr, served_names(state)))
    return error_response(404, f"model {name!r} does not exist; this server serves {served} (GET /v1/models)",
                          param="model", code="model_not_found")


def check_model(state: ServerState, name: str | None) -> JSONResponse | None:
    """A 404 listing the served names unless `name` is one of them (or absent: the base)."""
    if name is not None and name not in state.options.model_names and state.loras.get(name) is None:
        return model_not_found(state, name)
    return None


def admit(state: ServerState) -> JSONResponse | None:
    """429 when --max-queue requests already wait for a first token; else count this one as waiting."""
    opts = state.options
    if state.waiting >= opts.max_queue:
        return error_response(429, f"{state.waiting} requests are already waiting (--max-queue "
                              f"{opts.max_queue}); retry later", code="queue_full", headers={"Retry-After": "1"})
    state.waiting += 1
    return None


async def generate(request: Request, state: ServerState, req, prepare: Callable[[], Awaitable[Submission]]) -> Response:
    """Admit `req` (a parsed request body), run `prepare` inside the admission, and answer.

    The waiting count taken by `admit` is given back here if preparation fails, else by `deltas`
    at the first token (or when the generation ends without one).
    """
    if (bad := check_model(state, req.model)) is not None:
        return bad
    lora = state.loras.get(req.model)  # routed now: an unload from here on fails it with a 404, not the base
    if (busy := admit(state)) is not None:
        return busy
    try:
        sub = await prepare()
        gen = new_generation(state, sub, request, lora)
    except BaseException:
        state.waiting -= 1
        raise
    if req.stream:
        return StreamingResponse(stream_sse(state, gen, req, sub.shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await until_disconnect(request, state, collect_json(state, gen, req, sub.shape))


def new_generation(state: ServerState, sub: Submission, request: Request | None = None,
                   lora: LoRARequest | None = None) -> Generation:
    """The response id is the endpoint's prefix + the request id (the client's X-Request-Id when sent,
    as vLLM builds it); the engine's ids get a suffix of their own, since two clients may send the same.
    With an adapter, responses carry its name as `model` (as vLLM's do)."""
    given = request.scope.get("state", {}).get("request_id") if request is not None else None
    rid = sub.shape.id_prefix + (given or uuid.uuid4().hex)
    gen = Generation(state, rid, sub.prompts, sub.params, arrival=time.time(), tokenize_seconds=sub.tokenize_seconds,
                     engine_suffix="-" + uuid.uuid4().hex[:8] if given else "", lora=lora,
                     model_name=lora.lora_name if lora is not None else state.options.served_model_name)
    if request is not None:
        request.scope["state"]["generation"] = gen  # the access log line reads its token counts
    state.metrics.stage.labels("tokenize").inc(sub.tokenize_seconds)
    state.metrics.prompt_tokens.inc(gen.num_prompt_tokens)
    if lora is not None:
        state.metrics.lora_requests.labels(lora.lora_name).inc()
        state.metrics.lora_prompt_tokens.labels(lora.lora_name).inc(gen.num_prompt_tokens)
    return gen


async def until_disconnect(request: Request, state: ServerState, coro) -> Response:
    """Run a non-streaming request; if the client hangs up first, cancel it (which aborts it)."""
    work = asyncio.ensure_future(coro)
    state.in_flight.add(work)

    async def disconnected():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        state.in_flight.discard(work)
    if not work.done():
        work.cancel()
        logger.info("client disconnected; request aborted")
        try:
            await work
        except BaseException:
            pass
        return Response(status_code=499)
    watch.cancel()
    return work.result()


def record(state: ServerState, gen: Generation) -> None:
    """A finished generation's latency and token metrics."""
    metrics = state.metrics
    end = time.time()
    metrics.e2e.observe(end - gen.arrival)
    metrics.generation_tokens.inc(gen.num_output_tokens)
    if gen.lora is not None:
        metrics.lora_generation_tokens.labels(gen.lora.lora_name).inc(gen.num_output_tokens)
    metrics.stage.labels("detokenize").inc(gen.detokenize_seconds)
    if gen.first_token_time is not None:
        metrics.ttft.observe(gen.first_token_time - gen.arrival)
        n = max(c.num_tokens for c in gen.choices.values()) if gen.choices else 0
        if n > 1:
            metrics.tpot.observe((end - gen.first_token_time) / (n - 1))


async def deltas(state: ServerState, gen: Generation) -> AsyncIterator[ChoiceDelta]:
    """The generation's deltas, with the waiting count released at the first one."""
    counted = True
    state.metrics.in_flight.inc()
    try:
        async for d in gen.stream():
            if counted:
                state.waiting -= 1
                counted = False
            yield d
        record(state, gen)
    finally:
        if counted:
            state.waiting -= 1
        state.metrics.in_flight.dec()


async def collect_json(state: ServerState, gen: Generation, req, shape: ResponseShape) -> Response:
    """The whole response as one body; an engine failure becomes that request's error body."""
    text: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    try:
        async for d in deltas(state, gen):
            text.setdefault(d.index, []).append(d.text)
            finish[d.index] = d.finish_reason
            shape.keep_logprobs(d)
    except EngineRequestFailed as e:
        return error_response(e.status, _engine_message(e, gen.request_id))
    created = int(time.time())
    choices = [shape.choice(i, "".join(text.get(i, [])), finish.get(i)) for i in range(len(gen.prompts) * req.n)]
    body = {"id": gen.request_id, "object": shape.object_name, "created": created,
            "model": gen.model_name, "choices": choices,
            "usage": usage(gen.num_prompt_tokens, gen.num_output_tokens)}
    return JSONResponse(body)


def _engine_message(e: EngineRequestFailed, rid: str) -> str:
    """The engine's own words (they name no internals); a 5xx also gets the request id for the log."""
    return f"{e} (request id {rid})" if e.status >= 500 else str(e)


def _error_chunk(message: str, type_: str) -> bytes:
    return sse({"error": {"message": message, "type": type_, "param": None, "code": None}})


async def stream_sse(state: ServerState, gen: Generation, req, shape: ResponseShape) -> AsyncIterator[bytes]:
    """SSE chunks, an optional usage chunk, then `[DONE]`; a failure mid-stream is an error chunk
    and `[DONE]` (the status line is long gone). Registered in `in_flight` so drain waits for it."""
    model, created, rid = gen.model_name, int(time.time()), gen.request_id
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    task = asyncio.current_task()
    if task is not None:
        state.in_flight.add(task)
    stream_secs = 0.0
    try:
        async for d in deltas(state, gen):
            chunk = shape.chunk(rid, model, created, [shape.stream_choice(d)])
            t0 = time.perf_counter()
            yield sse(chunk)
            stream_secs += time.perf_counter() - t0
        if include_usage:
            yield sse(shape.chunk(rid, model, created, [], usage(gen.num_prompt_tokens, gen.num_output_tokens)))
        yield DONE
    except EngineRequestFailed as e:
        yield _error_chunk(_engine_message(e, rid), "server_error" if e.status >= 500 else "invalid_request_error")
        yield DONE
    except asyncio.CancelledError:
        logger.info("client disconnected mid-stream; request %s aborted", rid)
        raise
    except Exception:
        logger.exception("stream of %s failed", rid)
        yield _error_chunk(f"internal server error (request id {rid}; the details are in the server log)",
                           "server_error")
        yield DONE
    finally:
        state.metrics.stage.labels("stream").inc(stream_secs)
        if task is not None:
            state.in_flight.discard(task)
