"""The operator routes: /health (liveness), /ready (readiness) and /metrics; the outage gate.

/health is 200 while the server is up and can still recover (also while a child process is being
restarted), 503 once it has given up and is exiting. /ready is 200 only when the model has loaded,
the engine process is up, a tokenizer worker is alive (or tokenisation runs in the loop) and the
server is not draining. /health and /ready answer without an API key (see app.OPEN_PATHS) so
probes need no secret.

`install(app)` adds what the supervised children need on the HTTP side: `OutageGate`, which
answers new generation requests with a 503 naming the outage (engine died and is restarting, no
tokenizer worker alive) instead of letting them fail later, and a handler turning
`procs.ChildUnavailable` (e.g. a tokenizer job whose workers kept dying) into a 503 error body.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.middleware import Middleware

from strata.server.openai_api import error_response
from strata.server.procs import ChildUnavailable
from strata.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = server_state(request)
    if state.failed:
        return error_response(503, f"not live: {state.failed}", code="failed")
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    state = server_state(request)
    if state.ready and not state.draining and state.outage is None:
        return {"status": "ready"}
    if state.draining:
        return error_response(503, "not ready: draining", code="draining")
    if not state.ready:
        return error_response(503, "not ready: loading", code="loading")
    return error_response(503, f"not ready: {state.outage}", code="unavailable")


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(server_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


class OutageGate:
    """ASGI middleware inside app.Guard: while a started server has a child down, new generation
    requests (POST /v1/...) get 503 + Retry-After with the reason, streaming or not."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            why = self.state.outage if self.state.ready else None
            if why is not None:
                refusal = error_response(503, why, code="unavailable", headers={"Retry-After": "1"})
                return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


def install(app: FastAPI, state: ServerState) -> None:
    """Add OutageGate (innermost: after the Guard's auth and size checks) and the 503 handler."""
    app.user_middleware.append(Middleware(OutageGate, state=state))

    async def on_unavailable(request: Request, exc: ChildUnavailable):
        return error_response(exc.status, str(exc), code="unavailable", headers={"Retry-After": "1"})

    app.add_exception_handler(ChildUnavailable, on_unavailable)
