"""The small endpoints vLLM users call: POST /tokenize, POST /detokenize, GET /version.

Same request rules as the OpenAI routes (openai_api.py): strict JSON types, unknown fields refused,
a 400 naming the field. /tokenize takes a `prompt` (text) or chat `messages` (rendered with the
checkpoint's template, plus `tools`), tokenised by the same workers and rule as generation, so the
count is exactly what a completion request would be charged.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

import strata
from strata.errors import RequestError
from strata.server.generation_http import check_model
from strata.server.openai_api import _STRICT, ChatMessage, Tool, chat_messages
from strata.server.routes_openai import parse, read_body
from strata.server.state import server_state

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # prompt: default true; messages: the template writes them
    add_generation_prompt: bool | None = True
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


@router.get("/version")
async def version():
    return {"version": strata.__version__}


async def _read(request: Request, model_cls, param: str):
    """(server state, the typed body, a 404 response when it names another model, else None)."""
    state = server_state(request)
    req = parse(model_cls, await read_body(request, state.options.max_request_bytes))
    bad = check_model(state, req.model)
    if bad is None and state.tokenizer is None:
        raise RequestError("this model has no tokenizer.json: it takes token ids only", param=param)
    return state, req, bad


@router.post("/tokenize")
async def tokenize(request: Request):
    state, req, bad = await _read(request, TokenizeRequest, "prompt")
    if bad is not None:
        return bad
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give exactly one of prompt (text) or messages (a chat)", param="prompt")
    if req.prompt is not None:
        if req.tools:
            raise RequestError("tools go with messages, not with a plain prompt", param="tools")
        job = {"kind": "text", "text": req.prompt, "add_special_tokens": req.add_special_tokens is not False}
    else:
        if req.add_special_tokens:
            raise RequestError("add_special_tokens applies to prompt; a chat template writes its own special "
                               "tokens", param="add_special_tokens")
        if req.add_generation_prompt is False:
            raise RequestError("add_generation_prompt false is not implemented (chat prompts always end with the "
                               "assistant's turn); omit it", param="add_generation_prompt")
        job = {"kind": "chat", "messages": chat_messages(req)}
        if req.tools:
            job["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    ids, _ = await state.tokenizers.run(job)
    body = {"count": len(ids), "max_model_len": state.info.get("max_model_len"), "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = [state.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return body


@router.post("/detokenize")
async def detokenize(request: Request):
    state, req, bad = await _read(request, DetokenizeRequest, "tokens")
    if bad is not None:
        return bad
    vocab = state.info["vocab_size"]
    if any(t < 0 or t >= vocab for t in req.tokens):
        raise RequestError(f"tokens must be token ids in [0, {vocab})", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
