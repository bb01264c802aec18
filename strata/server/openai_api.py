"""OpenAI request bodies (pydantic) and their translation to SamplingParams; error bodies.

Unknown fields are ignored, as OpenAI-compatible servers do; a field of the wrong type or out of
range is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from strata.engine.sampling_params import SamplingParams
from strata.errors import RequestError

MAX_TOP_LOGPROBS_COMPLETIONS = 5  # OpenAI's limits
MAX_TOP_LOGPROBS_CHAT = 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(req: _Common, defaults: dict[str, Any], logprobs: int | None, max_tokens: int | None) -> SamplingParams:
    """Request fields, else the checkpoint's generation_config.json defaults, else SamplingParams'."""
    fields: dict[str, Any] = {
        "n": req.n, "stop": req.stop, "stop_token_ids": req.stop_token_ids or [], "max_tokens": max_tokens,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "seed": req.seed, "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens, "logprobs": logprobs,
        "skip_special_tokens": req.skip_special_tokens, "include_stop_str_in_output": req.include_stop_str_in_output,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
        elif name in defaults:
            fields[name] = defaults[name]
    return SamplingParams(**fields)


def completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS_COMPLETIONS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS_COMPLETIONS}], got {req.logprobs}", param="logprobs")
    return req.logprobs


def chat_logprobs(req: ChatRequest) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS_CHAT:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS_CHAT}], got {req.top_logprobs}",
                               param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; content parts of type text are joined."""
    out = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}",
                                       param=f"messages[{i}].content")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        out.append(d)
    return out


ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


Finish = Literal["stop", "length", "abort"]
