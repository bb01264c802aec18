"""OpenAI request bodies: the JSON checks, the field policy, the pydantic models, SamplingParams; errors.

A body is judged in this order, and the first problem is a 400 in the OpenAI error shape whose
`param` names the field (None and "request body" in the message when the body itself is bad):

1. `load_body`: valid JSON (UTF-8), an object, nested at most MAX_JSON_DEPTH levels, integer
   literals of at most MAX_INT_DIGITS digits, and no lone UTF-16 surrogate in any string or key.
2. `check_fields`: the fields below that Strata does not implement.
3. The pydantic models: strict types (no bool for an int, no "3" for a number, finite floats),
   and no unknown field (extra="forbid"): a field Strata does not know is refused, never ignored.
   `null` means the field's default, as in OpenAI's API.
4. `validate_request` (strata/protocol/validation.py): SamplingParams' ranges and limits (n <= MAX_N,
   seed in 64 bits, ...), then the prompts against the model's limits: the same function the
   offline API and the engine use.

Field policy. Implemented: every field declared on the models below. Accepted and ignored,
because they cannot change the output: `user`, `metadata`, `store`, `service_tier`,
`prompt_cache_key`, `safety_identifier`, `stream_options.include_obfuscation`, and, in a
message, `name` and `tool_call_id` (handed to the chat template, which may use or ignore them).
Not implemented, so a 400 naming the field unless it has the neutral value shown (then it is
a no-op and accepted): `best_of` (null or = n), `logit_bias` (null, {}), `suffix` (null, ""),
`use_beam_search` (null, false), the legacy `functions` (null, []) and `function_call`
(null, "none") (use tools),
`modalities` (null, ["text"]), `audio`, `prediction`, `reasoning_effort`, `verbosity`,
`web_search_options`, `prompt_logprobs`, `allowed_token_ids`, `bad_words`, `logits_processors`,
`truncate_prompt_tokens`, `chat_template`, `chat_template_kwargs` (null, {}),
`add_generation_prompt` (null, true), `continue_final_message` (null, false) (all others: null);
in a message, `function_call`, `audio`, `refusal` (null) and
`annotations` (null, []). Chat roles: system, user, assistant, tool, and developer (rendered as
system). Completions: `echo` with `logprobs` returns the prompt tokens' logprobs too (the first is null);
legacy `logprobs.tokens` join to the returned text and `text_offset` indexes into it (a skipped special
token, e.g. an added BOS, is an empty token; server/responses.py).
Tool calling: `tools`, `tool_choice`, `parallel_tool_calls`, and in messages `tool_calls` and
`tool_call_id` (server/tool_calls.py). Structured output: `response_format`, `structured_outputs` and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (server/structured_api.py; at most one).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from strata.errors import RequestError
from strata.protocol.sampling_params import SamplingParams
from strata.server.structured_api import GUIDED, structured_output

MAX_TOP_LOGPROBS_COMPLETIONS = 5  # OpenAI's limits
MAX_TOP_LOGPROBS_CHAT = 20
MAX_JSON_DEPTH = 32  # nesting levels of a request body (a chat body needs about 5)
MAX_INT_DIGITS = 100  # an integer literal longer than this is refused before it is converted

# --- 1. the JSON body ----------------------------------------------------------------------------
_SURROGATE = re.compile("[\ud800-\udfff]")


class _HugeInt:
    """Stands in for an integer literal too long to convert (so the check can name its field)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str):
    return int(text) if len(text) <= MAX_INT_DIGITS else _HugeInt(len(text.lstrip("-")))


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            key = p.encode("utf-8", "backslashreplace").decode("utf-8")  # a key may hold a surrogate
            out += f".{key}" if out else key
    return out


def load_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, with the structural checks of step 1."""
    try:
        data = json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise RequestError(f"request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    _check_values(data)
    return data


def _check_values(data: dict) -> None:
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, parts, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and (m := _SURROGATE.search(value)):
                raise RequestError(f"{_path(parts)} has a lone UTF-16 surrogate ({ord(m.group()):#x}) at character "
                                   f"{m.start()}: text must be valid Unicode", param=_path(parts))
        elif isinstance(value, _HugeInt):
            raise RequestError(f"{_path(parts)}: an integer literal of {value.digits} digits is out of range "
                               f"(at most {MAX_INT_DIGITS} digits; 64-bit fields take far fewer)", param=_path(parts))
        elif isinstance(value, list | dict):
            if depth > MAX_JSON_DEPTH:
                raise RequestError(f"request body is nested more than {MAX_JSON_DEPTH} levels deep (at "
                                   f"{_path(parts)})", param=_path(parts).split(".")[0].split("[")[0] or None)
            if isinstance(value, dict):
                for k, v in value.items():
                    stack.append((k, (*parts, k), depth + 1))  # keys are strings: the surrogate check
                    if not (type(v) is int or type(v) is float or v is None or type(v) is bool):
                        stack.append((v, (*parts, k), depth + 1))
            else:
                for i, v in enumerate(value):
                    if not (type(v) is int or type(v) is float or v is None or type(v) is bool):
                        stack.append((v, (*parts, i), depth + 1))


# --- 2. fields Strata does not implement ---------------------------------------------------------
def _is(*neutral):
    """True for null or one of `neutral` (same type: false is not 0)."""
    return lambda v: v is None or any(type(v) is type(n) and v == n for n in neutral)


_UNSUPPORTED: dict[str, tuple[Any, str]] = {  # field: (neutral value test, what it would do)
    "logit_bias": (_is({}), "token biases"),
    "suffix": (_is(""), "text after the insertion point"),
    "use_beam_search": (_is(False), "beam search"),
    "functions": (_is([]), "function calling"),
    "function_call": (_is("none"), "function calling"),
    "modalities": (_is(["text"]), "non-text output"),
    "audio": (_is(), "audio output"),
    "prediction": (_is(), "predicted outputs"),
    "reasoning_effort": (_is(), "reasoning models"),
    "verbosity": (_is(), "reasoning models"),
    "web_search_options": (_is(), "web search"),
    "prompt_logprobs": (_is(), "prompt logprobs"),
    "allowed_token_ids": (_is(), "restricting the vocabulary"),
    "bad_words": (_is([]), "banned words"),
    "logits_processors": (_is(), "logits processors"),
    "truncate_prompt_tokens": (_is(), "prompt truncation"),
    "chat_template": (_is(), "a request's own chat template"),
    "chat_template_kwargs": (_is({}), "chat template arguments"),
    "add_generation_prompt": (_is(True), "rendering without the generation prompt"),
    "continue_final_message": (_is(False), "continuing the final message"),
}
_UNSUPPORTED_IN_MESSAGE: dict[str, tuple[Any, str]] = {
    "function_call": (_is(), "function calling"),
    "audio": (_is(), "audio"),
    "refusal": (_is(), "refusal messages (put the text in content)"),
    "annotations": (_is([]), "annotations"),
}


def _not_implemented(param: str, what: str) -> RequestError:
    return RequestError(f"{param} is not implemented by Strata ({what}); omit it", param=param)


def _drop_unsupported(d: dict, table: dict, prefix: str = "") -> dict:
    out = dict(d)
    for name, (neutral, what) in table.items():
        if name in out:
            if not neutral(out[name]):
                raise _not_implemented(prefix + name, what)
            del out[name]
    return out


def check_fields(data: dict[str, Any]) -> dict[str, Any]:
    """Step 2: refuse fields Strata does not implement; drop those given their neutral value."""
    out = _drop_unsupported(data, _UNSUPPORTED)
    if "best_of" in out:
        best_of, n = out.pop("best_of"), out.get("n")
        if best_of is not None and not (type(best_of) is int and best_of == (1 if n is None else n)):
            raise _not_implemented("best_of", "generating best_of completions and returning the n best; "
                                   "omit it or make it equal to n")
    if isinstance(out.get("messages"), list):
        out["messages"] = [_drop_unsupported(m, _UNSUPPORTED_IN_MESSAGE, f"messages[{i}].") if isinstance(m, dict)
                           else m for i, m in enumerate(out["messages"])]
    return out


# --- 3. the models -------------------------------------------------------------------------------
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, protected_namespaces=())


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # ignored: Strata never pads its chunks


_NULL_MEANS = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False, "min_tokens": 0,
               "skip_special_tokens": True, "include_stop_str_in_output": False, "stream": False, "echo": False}


class _Common(BaseModel):
    model_config = _STRICT

    model: str | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # structured output (server/structured_api.py): at most one of these
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored (they cannot change the output):
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _null_is_default(self):
        for name, default in _NULL_MEANS.items():
            if getattr(self, name, default) is None:
                setattr(self, name, default)
        if isinstance(self, ChatRequest) and self.logprobs is None:
            self.logprobs = False
        return self


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None  # null only for an assistant's tool calls
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # calls always follow the schema when Strata enforces them


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


_UNION_RULES = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def _is_tag(x) -> bool:
    """A pydantic union member's name in an error location ('str', 'list[int]', ...), not a field."""
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict", "list"))


def _short(v) -> str:
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, int | float | str):
        text = repr(v)
        return text if len(text) <= 60 else text[:60] + "..."
    return f"a JSON {'array' if isinstance(v, list) else 'object'}" if isinstance(v, list | dict) else type(v).__name__


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first one, its field named."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [x for x in first.get("loc", ()) if x != "body"]
    tag = next((i for i, x in enumerate(loc) if _is_tag(x)), None)
    param = _path(tuple(loc if tag is None else loc[:tag])) or None
    if first.get("type") == "extra_forbidden":
        return (f"unknown field {param!r}: Strata does not implement it, and refuses fields it would otherwise "
                "ignore silently (see strata/server/openai_api.py for the accepted fields)", param)
    if tag is not None:
        rule = _UNION_RULES.get(str(loc[tag - 1]) if tag else "")
        if rule is None:
            same = [e["msg"] for e in errors if [x for x in e["loc"] if x != "body"][:tag] == loc[:tag]]
            rule = " or ".join(dict.fromkeys(same))
        return f"invalid field {param!r}: {rule}", param
    got = f" (got {_short(first['input'])})" if "input" in first and first.get("type") != "missing" else ""
    return f"invalid field {param!r}: {first.get('msg', 'invalid')}{got}", param


# --- 4. to SamplingParams ------------------------------------------------------------------------
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
    fields["structured"], _ = structured_output({name: getattr(req, name) for name in _STRUCTURED_FIELDS})
    return SamplingParams(**fields)


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED)


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
    """Messages as the chat template expects them; text parts joined; developer rendered as system."""
    out = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise RequestError(f"invalid field 'messages[{i}].content': must be a string or a list of text parts "
                               "(null only in an assistant message with tool_calls)", param=f"messages[{i}].content")
        if m.role == "developer":
            d["role"] = "system"
        if m.tool_calls:  # templates read the arguments as a mapping (`| tojson`), as vLLM hands them
            for j, call in enumerate(d["tool_calls"]):
                try:
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                except ValueError:
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise RequestError(f"{where} must be JSON text (an object)", param=where) from None
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}: only text parts are supported, got type {_short(part.get('type'))}",
                                       param=f"{where}.type")
                if extra := sorted(set(part) - {"type", "text"}):
                    raise RequestError(f"{where}: unknown field {extra[0]!r} in a text part", param=f"{where}.{extra[0]}")
                texts.append(part["text"])
            d["content"] = "".join(texts)
        out.append(d)
    return out


# --- errors --------------------------------------------------------------------------------------
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


Finish = Literal["stop", "length", "abort"]
