"""The HTTP face: FastAPI routes for the OpenAI API, health, readiness and metrics.

The event loop only parses, validates, routes and formats: tokenisation goes to the worker pool,
the model runs in the engine process. Every failure is an OpenAI-style error body for that
request alone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.errors import RequestError
from strata.server import faults
from strata.server.generation import EngineRequestFailed, Generation, check_length
from strata.server.metrics import Metrics
from strata.server.openai_api import (
    ChatRequest,
    CompletionRequest,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    error_response,
    sampling_params,
)
from strata.server.responses import CompletionLogprobs, chat_chunk, completion_chunk, usage
from strata.server.responses import chat_logprobs as format_chat_logprobs

logger = logging.getLogger("strata.server")

OPEN_PATHS = ("/health", "/ready")  # answered without an API key


@dataclass
class ServerOptions:
    served_model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_queue: int = 256
    drain_timeout: float = 30.0


@dataclass
class ServerState:
    options: ServerOptions
    metrics: Metrics
    engine: object = None  # EngineClient once started
    tokenizers: object = None  # TokenizerPool or InLoopTokenizer
    tokenizer: object = None  # the front end's own copy, for detokenisation
    info: dict = field(default_factory=dict)
    ready: bool = False
    draining: bool = False
    waiting: int = 0  # admitted requests without a first token yet (what --max-queue bounds)
    in_flight: set = field(default_factory=set)  # asyncio tasks serving generation requests


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class BodyTooLarge(Exception):
    pass


def too_large(limit: int, size: int | None) -> JSONResponse:
    got = f"{size} bytes" if size is not None else "larger than that"
    return error_response(413, f"request body is {got}; the limit is {limit} bytes (--max-request-bytes)",
                          code="request_too_large")


class Guard:
    """ASGI middleware: API key, declared body size and readiness checks, and request counting.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass straight through.
    """

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    def _refuse(self, scope) -> JSONResponse | None:
        opts, path = self.state.options, scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if opts.api_key and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {opts.api_key}".encode()):
                return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                                      "key the server was started with (--api-key / STRATA_API_KEY)",
                                      code="invalid_api_key")
        if scope["method"] == "POST":
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > opts.max_request_bytes:
                return too_large(opts.max_request_bytes, int(length))
            if path.startswith("/v1/") and (self.state.draining or not self.state.ready):
                msg = ("server is draining and takes no new requests" if self.state.draining
                       else "model is still loading; retry when GET /ready returns 200")
                return error_response(503, msg, code="unavailable", headers={"Retry-After": "1"})
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        path = scope["path"]
        endpoint = path if path.startswith("/v1/") or path in ("/health", "/ready", "/metrics") else "other"
        try:
            refusal = self._refuse(scope)
            if refusal is not None:
                await refusal(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Strata", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.strata = state
    opts = state.options
    metrics = state.metrics

    app.add_middleware(Guard, state=state)

    @app.exception_handler(BodyTooLarge)
    async def on_too_large(request: Request, exc: BodyTooLarge):
        return too_large(opts.max_request_bytes, None)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}", param=None)
        return error_response(400, f"invalid field {param!r}: {first.get('msg', 'invalid')}", param=param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        logger.error("request to %s failed", request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc} (traceback in the server log)")

    # --- plain endpoints ---------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.ready and not state.draining:
            return {"status": "ready"}
        reason = "draining" if state.draining else "loading"
        return error_response(503, f"not ready: {reason}", code=reason)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": opts.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "strata",
            "max_model_len": state.info.get("max_model_len"),
        }]}

    # --- generation ----------------------------------------------------------------------------
    async def read_body(request: Request) -> dict:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > opts.max_request_bytes:
                raise BodyTooLarge()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise RequestError("request body must be a JSON object")
        return data

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name != opts.served_model_name:
            return error_response(404, f"model {name!r} does not exist; this server serves "
                                  f"{opts.served_model_name!r} (GET /v1/models)", param="model", code="model_not_found")
        return None

    def admit() -> JSONResponse | None:
        if state.waiting >= opts.max_queue:
            return error_response(429, f"{state.waiting} requests are already waiting (--max-queue "
                                  f"{opts.max_queue}); retry later", code="queue_full", headers={"Retry-After": "1"})
        state.waiting += 1
        return None

    async def tokenize_job(job: dict) -> tuple[list[int], float]:
        return await state.tokenizers.run(job)

    def parse(model_cls, data: dict):
        try:
            return model_cls.model_validate(data)
        except Exception as e:  # pydantic.ValidationError -> FastAPI's handler shape
            if hasattr(e, "errors"):
                raise RequestValidationError(e.errors()) from None
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await read_body(request))
        if (bad := check_model(req.model)) is not None:
            return bad
        if (busy := admit()) is not None:
            return busy
        try:
            texts, prompts, secs = await _completion_prompts(req)
            for t in texts:
                if t is not None and faults.should_raise(t):
                    raise RuntimeError("planted fault (STRATA_TEST_FAULTS raise_on)")
            params = sampling_params(req, state.info.get("generation_defaults", {}), completion_logprobs(req), req.max_tokens)
            params.validate(0, state.info["vocab_size"])
            for i, ids in enumerate(prompts):
                check_length(ids, params.max_tokens, state.info["max_model_len"], i)
            gen = _generation(prompts, params, secs, "cmpl-")
        except BaseException:
            state.waiting -= 1
            raise
        return await _respond(request, gen, req, texts, chat=False)

    async def _completion_prompts(req: CompletionRequest):
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise RequestError("prompt is empty; give text or token ids", param="prompt")
        vocab = state.info["vocab_size"]
        texts, prompts, secs = [], [], 0.0
        results = await asyncio.gather(*[
            tokenize_job({"kind": "text", "text": x}) for x in items if isinstance(x, str)
        ])
        it = iter(results)
        for x in items:
            if isinstance(x, str):
                ids, s = next(it)
                texts.append(x)
                secs += s
            else:
                if any(t < 0 or t >= vocab for t in x):
                    raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
                ids = list(x)
                texts.append(None)
            prompts.append(ids)
        return texts, prompts, secs

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await read_body(request))
        if (bad := check_model(req.model)) is not None:
            return bad
        if (busy := admit()) is not None:
            return busy
        try:
            messages = chat_messages(req)
            if any(faults.should_raise(str(m.get("content", ""))) for m in messages):
                raise RuntimeError("planted fault (STRATA_TEST_FAULTS raise_on)")
            ids, secs = await tokenize_job({"kind": "chat", "messages": messages})
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            params = sampling_params(req, state.info.get("generation_defaults", {}), chat_logprobs(req), max_tokens)
            params.validate(0, state.info["vocab_size"])
            if params.max_tokens is None:  # chat default: the rest of the context
                params.max_tokens = max(1, state.info["max_model_len"] - len(ids))
            check_length(ids, params.max_tokens, state.info["max_model_len"])
            gen = _generation([ids], params, secs, "chatcmpl-")
        except BaseException:
            state.waiting -= 1
            raise
        return await _respond(request, gen, req, [None], chat=True)

    def _generation(prompts, params, tokenize_seconds, prefix: str) -> Generation:
        rid = prefix + uuid.uuid4().hex
        gen = Generation(state, rid, prompts, params, arrival=time.time(), tokenize_seconds=tokenize_seconds)
        metrics.stage.labels("tokenize").inc(tokenize_seconds)
        metrics.prompt_tokens.inc(gen.num_prompt_tokens)
        return gen

    async def _respond(request: Request, gen: Generation, req, texts, chat: bool):
        if req.stream:
            return StreamingResponse(_stream(gen, req, texts, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _until_disconnect(request, _collect(gen, req, texts, chat))

    async def _until_disconnect(request: Request, coro):
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

    def _record(gen: Generation) -> None:
        end = time.time()
        metrics.e2e.observe(end - gen.arrival)
        metrics.generation_tokens.inc(gen.num_output_tokens)
        metrics.stage.labels("detokenize").inc(gen.detokenize_seconds)
        if gen.first_token_time is not None:
            metrics.ttft.observe(gen.first_token_time - gen.arrival)
            n = max(c.num_tokens for c in gen.choices.values()) if gen.choices else 0
            if n > 1:
                metrics.tpot.observe((end - gen.first_token_time) / (n - 1))

    async def _deltas(gen: Generation):
        """The generation's deltas, with the waiting count released at the first one."""
        counted = True
        metrics.in_flight.inc()
        try:
            async for d in gen.stream():
                if counted:
                    state.waiting -= 1
                    counted = False
                yield d
            _record(gen)
        finally:
            if counted:
                state.waiting -= 1
            metrics.in_flight.dec()

    async def _collect(gen: Generation, req, texts, chat: bool):
        model = opts.served_model_name
        n = req.n
        out_text: dict[int, list[str]] = {}
        out_lp: dict[int, list] = {}
        finish: dict[int, str | None] = {}
        tok = state.tokenizer
        num_top = (req.top_logprobs or 0) if chat else (req.logprobs or 0)
        lp_writers: dict[int, CompletionLogprobs] = {}
        try:
            async for d in _deltas(gen):
                out_text.setdefault(d.index, []).append(d.text)
                finish[d.index] = d.finish_reason
                if d.logprobs is not None:
                    if chat:
                        out_lp.setdefault(d.index, []).extend(format_chat_logprobs(tok, d.token_ids, d.logprobs, num_top))
                    else:
                        w = lp_writers.setdefault(d.index, CompletionLogprobs(tok))
                        out_lp.setdefault(d.index, []).append(w.add(d.token_ids, d.logprobs, num_top))
        except EngineRequestFailed as e:
            return error_response(e.status, str(e))
        created = int(time.time())
        choices = []
        for i in range(len(gen.prompts) * n):
            text = "".join(out_text.get(i, []))
            if chat:
                lp = {"content": out_lp.get(i, [])} if req.logprobs else None
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": finish.get(i)})
            else:
                if req.echo:
                    text = _prompt_text(gen, texts, i // n) + text
                lp = CompletionLogprobs.merge(out_lp.get(i, [])) if req.logprobs is not None else None
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish.get(i)})
        body = {"id": gen.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model, "choices": choices,
                "usage": usage(gen.num_prompt_tokens, gen.num_output_tokens)}
        return JSONResponse(body)

    def _prompt_text(gen: Generation, texts, p: int) -> str:
        return texts[p] if texts[p] is not None else state.tokenizer.decode(gen.prompts[p])

    async def _stream(gen: Generation, req, texts, chat: bool) -> AsyncIterator[bytes]:
        model, created, rid = opts.served_model_name, int(time.time()), gen.request_id
        tok = state.tokenizer
        num_top = (req.top_logprobs or 0) if chat else (req.logprobs or 0)
        started: set[int] = set()
        lp_writers: dict[int, CompletionLogprobs] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        task = asyncio.current_task()
        if task is not None:
            state.in_flight.add(task)
        stream_secs = 0.0
        try:
            async for d in _deltas(gen):
                if chat:
                    delta: dict = {}
                    if d.index not in started:
                        delta["role"] = "assistant"
                        started.add(d.index)
                    if d.text or "role" in delta:
                        delta["content"] = d.text
                    lp = None
                    if d.logprobs is not None and req.logprobs:
                        lp = {"content": format_chat_logprobs(tok, d.token_ids, d.logprobs, num_top)}
                    choice = {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
                    chunk = chat_chunk(rid, model, created, [choice])
                else:
                    text = d.text
                    if req.echo and d.index not in started:
                        text = _prompt_text(gen, texts, d.index // req.n) + text
                    started.add(d.index)
                    lp = None
                    if d.logprobs is not None:
                        w = lp_writers.setdefault(d.index, CompletionLogprobs(tok))
                        lp = w.add(d.token_ids, d.logprobs, num_top)
                    choice = {"index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}
                    chunk = completion_chunk(rid, model, created, [choice])
                t0 = time.perf_counter()
                yield _sse(chunk)
                stream_secs += time.perf_counter() - t0
            if include_usage:
                u = usage(gen.num_prompt_tokens, gen.num_output_tokens)
                yield _sse((chat_chunk if chat else completion_chunk)(rid, model, created, [], u))
            yield b"data: [DONE]\n\n"
        except EngineRequestFailed as e:
            yield _sse({"error": {"message": str(e), "type": "server_error" if e.status >= 500 else
                                  "invalid_request_error", "param": None, "code": None}})
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            logger.info("client disconnected mid-stream; request %s aborted", rid)
            raise
        except Exception:
            logger.exception("stream of %s failed", rid)
            yield _sse({"error": {"message": "internal error (traceback in the server log)", "type": "server_error",
                                  "param": None, "code": None}})
            yield b"data: [DONE]\n\n"
        finally:
            metrics.stage.labels("stream").inc(stream_secs)
            if task is not None:
                state.in_flight.discard(task)

    return app
