"""The operator routes: /health (process up), /ready (model loaded, not draining) and /metrics.

/health and /ready answer without an API key (see app.OPEN_PATHS) so probes need no secret.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from strata.server.openai_api import error_response
from strata.server.state import server_state

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    state = server_state(request)
    if state.ready and not state.draining:
        return {"status": "ready"}
    reason = "draining" if state.draining else "loading"
    return error_response(503, f"not ready: {reason}", code=reason)


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(server_state(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
