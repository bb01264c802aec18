"""The HTTP face: the FastAPI app factory and the Guard middleware in front of every route.

The routes live in routes_ops (health, readiness, metrics) and routes_openai (the OpenAI API).
The event loop only parses, validates, routes and formats: tokenisation goes to the worker pool,
the model runs in the engine process. Every failure is an OpenAI-style error body for that
request alone.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from strata.errors import RequestError
from strata.server import routes_openai, routes_ops
from strata.server.openai_api import error_response
from strata.server.routes_openai import BodyTooLarge
from strata.server.state import ServerOptions, ServerState

__all__ = ["Guard", "ServerOptions", "ServerState", "build_app"]

logger = logging.getLogger("strata.server")

OPEN_PATHS = ("/health", "/ready")  # answered without an API key


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

    app.include_router(routes_ops.router)
    app.include_router(routes_openai.router)
    return app
