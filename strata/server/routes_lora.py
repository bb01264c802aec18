"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's routes, bodies and answers.

Both answer only when the server was started with --enable-lora --enable-lora-updates --lora-dir
DIR (vLLM gates them with VLLM_ALLOW_RUNTIME_LORA_UPDATING; here it is a flag); otherwise a 404
naming those flags (vLLM's status: it has no such route then). They sit behind the API key like
every /v1 route (app.Guard). A load reads only from inside --lora-dir (server/lora.py), checks the
files in the front end, then has the engine read and check the weights on its worker thread; the
name is served once the engine said yes. An unload stops routing the name at once; requests the
engine already runs with it finish with its weights.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from strata.protocol.lora import LoRAError
from strata.server.engine_client import EngineDied, EngineRefused
from strata.server.lora import UPDATES_OFF, check_adapter_files
from strata.server.openai_api import _STRICT, error_response
from strata.server.routes_openai import parse, read_body
from strata.server.state import ServerState, server_state

logger = logging.getLogger("strata.server")
router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace the adapter of that name; refused for now (see below)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = _STRICT
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; when given it must be the adapter's id


def _off(state: ServerState) -> JSONResponse | None:
    if state.loras.enabled and state.loras.updates:
        return None
    return error_response(404, UPDATES_OFF, code="lora_updates_disabled")


def _refused(e: Exception, param: str | None = None) -> JSONResponse:
    return error_response(400, str(e), param=param, code="invalid_lora_adapter")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    state = server_state(request)
    if (off := _off(state)) is not None:
        return off
    req = parse(LoadLoRAAdapterRequest, await read_body(request, state.options.max_request_bytes))
    reg, name = state.loras, req.lora_name
    if req.load_inplace:  # the engine holds one id per name, so a swap would refuse requests mid-way
        return _refused("load_inplace is not supported yet: unload the adapter, then load it again (requests "
                        "running with it finish with the old weights)", "load_inplace")
    try:
        reg.check_name(name, state.options.model_names)
    except LoRAError as e:
        return _refused(e, "lora_name")
    try:
        path = reg.runtime_path(req.lora_path)
    except LoRAError as e:
        return _refused(e, "lora_path")
    try:
        lora = reg.new(name, path)
    except LoRAError as e:  # the name's characters
        return _refused(e, "lora_name")
    try:
        check_adapter_files(lora)  # missing files, a pickle, DoRA...: answered without the engine
    except LoRAError as e:
        return _refused(e, "lora_path")
    reg.loading.add(name)
    try:
        await state.engine.load_lora(lora)
    except LoRAError as e:  # what the engine found: shapes, rank above --max-lora-rank, ...
        return _refused(e, "lora_path")
    except EngineRefused as e:
        return error_response(e.status, str(e), code="internal_error")
    finally:
        reg.loading.discard(name)
    reg.add(lora)
    logger.info("LoRA adapter %s loaded from %s (id %d)", name, lora.path, lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    state = server_state(request)
    if (off := _off(state)) is not None:
        return off
    req = parse(UnloadLoRAAdapterRequest, await read_body(request, state.options.max_request_bytes))
    reg, name = state.loras, req.lora_name
    if name in reg.loading:
        return _refused(f"LoRA adapter {name!r} is being loaded; unload it once the load has answered", "lora_name")
    lora = reg.get(name)
    if lora is None:
        served = ", ".join(map(repr, reg.names())) or "none"
        return error_response(404, f"LoRA adapter {name!r} is not loaded (loaded adapters: {served})",
                              param="lora_name", code="model_not_found")
    if req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id:
        return _refused(f"LoRA adapter {name!r} has lora_int_id {lora.lora_int_id}, not {req.lora_int_id}; "
                        "omit lora_int_id or give that one", "lora_int_id")
    reg.remove(name)  # no new request is routed to it from here on
    await _unload_in_engine(state, lora)
    logger.info("LoRA adapter %s unloaded", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _unload_in_engine(state: ServerState, lora) -> None:
    try:
        await state.engine.unload_lora(lora)
    except EngineDied:
        pass  # a restarted engine starts without it: the registry no longer holds it
