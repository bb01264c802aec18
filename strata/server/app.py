"""The HTTP face: the FastAPI app factory and the Guard middleware in front of every route.

The routes live in routes_ops (health, readiness, metrics), routes_openai (the OpenAI API),
routes_tokenize (/tokenize, /detokenize, /version) and routes_lora (loading LoRA adapters).
The event loop only parses, validates, routes and formats: tokenisation goes to the worker pool,
the model runs in the engine process. Every failure is an OpenAI-style error body for that
request alone.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from strata.errors import RequestError
from strata.server import routes_lora, routes_openai, routes_ops, routes_tokenize
from strata.server.openai_api import error_response, validation_message
from strata.server.routes_openai import BodyTooLarge
from strata.server.state import ServerOptions, ServerState

__all__ = ["Guard", "ServerOptions", "ServerState", "build_app"]

logger = logging.getLogger("strata.server")
access_log = logging.getLogger("strata.access")  # one line per request; --disable-log-requests turns it off

OPEN_PATHS = ("/health", "/ready")  # answered without an API key
ROUTES = ("/v1/models, /v1/completions, /v1/chat/completions, /health, /ready, /metrics (and, with "
          "--enable-lora-updates, /v1/load_lora_adapter, /v1/unload_lora_adapter)")
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (counted in /metrics)


REQUEST_ID = re.compile(r"[!-~]{1,256}")  # a client's X-Request-Id: visible ASCII, no spaces (log-safe)


def request_id(scope) -> str:
    """The request's id: the client's X-Request-Id when it sent one (Guard checked it), else a fresh one."""
    return scope.setdefault("state", {}).setdefault("request_id", uuid.uuid4().hex)


KNOWN_PATHS = frozenset(("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/ready", "/metrics",
                         "/v1/load_lora_adapter", "/v1/unload_lora_adapter"))


def metric_endpoint(path: str) -> str:
    """The `endpoint` label: a known route, else "other" (a client must not mint label values)."""
    if path in KNOWN_PATHS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def internal_error(scope, exc: BaseException) -> JSONResponse:
    """A 500 that says nothing of the failure but its request id; the traceback goes to the log."""
    rid = request_id(scope)
    logger.error("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"), exc_info=exc)
    return error_response(500, f"internal server error (request id {rid}; the details are in the server log)",
                          code="internal_error", headers={"X-Request-Id": rid})


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

    def _refuse(self, scope, headers: dict[str, str]) -> JSONResponse | None:
        opts, path = self.state.options, scope["path"]
        given_id = headers.get("x-request-id")
        if given_id is not None and not REQUEST_ID.fullmatch(given_id):
            return error_response(400, "X-Request-Id must be 1 to 256 visible ASCII characters without spaces",
                                  param="X-Request-Id", code="invalid_request_id")
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
        t0 = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given_id = headers.get("x-request-id")
        state = scope.setdefault("state", {})
        if given_id is not None and REQUEST_ID.fullmatch(given_id):
            state["request_id"] = given_id  # honoured: the response ids are built on it (as vLLM does)
        rid = request_id(scope)

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                names = {k.lower() for k, _ in message.get("headers", [])}
                if b"x-request-id" not in names:  # echoed (or minted) on every response
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        path = scope["path"]
        endpoint = metric_endpoint(path)
        started = [False]

        async def send_tracked(message) -> None:
            if message["type"] == "http.response.start":
                started[0] = True
            await send_status(message)

        try:
            refusal = self._refuse(scope, headers)
            if refusal is not None:
                await refusal(scope, receive, send_tracked)
            else:
                await self.app(scope, receive, send_tracked)
        except Exception as exc:  # not handled by a route or a handler: one log entry, a generic body
            if started[0]:
                raise  # the status line is gone; let the server close the connection
            await internal_error(scope, exc)(scope, receive, send_status)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()
            if self.state.options.log_requests:
                self._log(scope, status[0], time.perf_counter() - t0, rid)

    @staticmethod
    def _log(scope, status: int, seconds: float, rid: str) -> None:
        """`POST /v1/completions 200 812.3ms in=12 out=32 id=...` (tokens of generation requests only)."""
        gen = scope.get("state", {}).get("generation")
        tokens = f" in={gen.num_prompt_tokens} out={gen.num_output_tokens}" if gen is not None else ""
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]} " if client else ""
        access_log.info("%s%s %s %d %.1fms%s id=%s", peer, scope["method"], scope["path"], status,
                        seconds * 1000, tokens, rid)


def build_app(state: ServerState) -> FastAPI:
    """The app over `state` (reachable by routes as request.app.state.strata)."""
    app = FastAPI(title="Strata", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.strata = state
    opts = state.options

    app.add_middleware(Guard, state=state)

    @app.exception_handler(BodyTooLarge)
    async def on_too_large(request: Request, exc: BodyTooLarge):
        return too_large(opts.max_request_bytes, None)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param=param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message, code = f"no route {method} {path}; this server answers {ROUTES}", "not_found"
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            message, code = f"{path} does not accept {method}" + (f"; use {allow}" if allow else ""), "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return error_response(exc.status_code, message, code=code, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, exc: ClientDisconnect):
        logger.info("client disconnected while sending the body of %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):  # a fallback: Guard answers these first
        return internal_error(request.scope, exc)

    app.include_router(routes_ops.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_tokenize.router)
    app.include_router(routes_lora.router)
    return app
