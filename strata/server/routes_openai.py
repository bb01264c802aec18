"""The OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions.

Each generation route only reads and validates its body and builds its prompts (chat renders the
template); the rest is `generation_http.generate`. The endpoints' differing output layouts are
the two `ResponseShape`s below.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from pydantic import ValidationError

from strata.errors import RequestError
from strata.protocol import structured
from strata.protocol.sampling_params import StructuredOutput
from strata.protocol.validation import ModelLimits, validate_request
from strata.server import faults
from strata.server.generation import ChoiceDelta
from strata.server.generation_http import Submission, generate, model_not_found, served_names
from strata.server.openai_api import (
    ChatRequest,
    CompletionRequest,
    NamedToolChoice,
    chat_logprobs,
    chat_messages,
    check_fields,
    completion_logprobs,
    load_body,
    sampling_params,
    validation_message,
)
from strata.server.responses import CompletionLogprobs, chat_chunk, completion_chunk, prompt_text
from strata.server.responses import chat_logprobs as format_chat_logprobs
from strata.server.state import ServerState, server_state
from strata.server.tool_calls import (
    ToolCallStream,
    check_tools,
    forced_call_grammar,
    forced_call_limit,
    parse_tool_calls,
)

router = APIRouter()


class BodyTooLarge(Exception):
    """The body outgrew --max-request-bytes while being read (no or a false Content-Length); 413."""


def _model_card(state: ServerState, name: str) -> dict:
    """vLLM's card: an adapter's `root` is its directory and `parent` the base it runs on."""
    lora = state.loras.get(name) if name not in state.options.model_names else None
    card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "strata",
            "root": state.info.get("model_path"), "parent": None, "max_model_len": state.info.get("max_model_len")}
    if lora is not None:
        card["root"], card["parent"] = lora.path, lora.base_model_name or state.options.served_model_name
    return card


@router.get("/v1/models")
async def models(request: Request):
    state = server_state(request)  # every --served-model-name, the primary first, then the adapters (as vLLM)
    return {"object": "list", "data": [_model_card(state, name) for name in served_names(state)]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    state = server_state(request)
    if model_id not in served_names(state):
        return model_not_found(state, model_id)
    return _model_card(state, model_id)


@router.post("/v1/completions")
async def completions(request: Request):
    state = server_state(request)
    req = parse(CompletionRequest, await read_body(request, state.options.max_request_bytes))
    return await generate(request, state, req, lambda: prepare_completion(state, req))


@router.post("/v1/chat/completions")
async def chat(request: Request):
    state = server_state(request)
    req = parse(ChatRequest, await read_body(request, state.options.max_request_bytes))
    return await generate(request, state, req, lambda: prepare_chat(state, req))


# --- request bodies ------------------------------------------------------------------------------
async def read_body(request: Request, limit: int) -> dict:
    """The JSON object body, read with the size limit enforced as it arrives, then checked
    (openai_api.load_body; starlette's ClientDisconnect if the client hangs up meanwhile)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge()
    return load_body(bytes(body))


def parse(model_cls, data: dict):
    """The typed request, or a RequestError naming the first bad field."""
    try:
        return model_cls.model_validate(check_fields(data))
    except ValidationError as e:
        message, param = validation_message(e.errors(include_url=False))
        raise RequestError(message, param=param) from None


def _planted_fault() -> RuntimeError:
    return RuntimeError("planted fault (STRATA_TEST_FAULTS raise_on)")


# --- prompts -------------------------------------------------------------------------------------
async def prepare_completion(state: ServerState, req: CompletionRequest) -> Submission:
    params = sampling_params(req, state.info.get("generation_defaults", {}), completion_logprobs(req), req.max_tokens)
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens carry logprobs too
        params.prompt_logprobs = req.logprobs
    limits = ModelLimits.from_info(state.info)
    validate_request(params, limits, api=True)  # before tokenizing: bad parameters cost nothing
    texts, prompts, secs = await completion_prompts(state, req)
    for t in texts:
        if t is not None and faults.should_raise(t):
            raise _planted_fault()
    validate_request(params, limits, prompts, api=True, ids_from_client=[t is None for t in texts])
    return Submission(prompts, params, secs, CompletionShape(req, state.tokenizer, prompts, params.skip_special_tokens))


async def completion_prompts(state: ServerState, req: CompletionRequest):
    """(texts, token ids, tokenize seconds) per prompt; text is None for a prompt given as ids."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise RequestError("prompt is empty; give text or token ids", param="prompt")
    texts, prompts, secs = [], [], 0.0
    results = await asyncio.gather(*[
        state.tokenizers.run({"kind": "text", "text": x}) for x in items if isinstance(x, str)
    ])
    it = iter(results)
    for x in items:
        if isinstance(x, str):
            ids, s = next(it)
            texts.append(x)
            secs += s
        else:  # checked against the vocabulary by validate_request
            ids = list(x)
            texts.append(None)
        prompts.append(ids)
    return texts, prompts, secs


async def prepare_chat(state: ServerState, req: ChatRequest) -> Submission:
    messages = chat_messages(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, state.info.get("generation_defaults", {}), chat_logprobs(req), max_tokens)
    limits = ModelLimits.from_info(state.info)
    validate_request(params, limits, api=True)  # before tokenizing: bad parameters cost nothing
    if any(faults.should_raise(str(m.get("content", ""))) for m in messages):
        raise _planted_fault()
    job: dict = {"kind": "chat", "messages": messages}
    parse_format = _tools(state, req, params, job)
    ids, secs = await state.tokenizers.run(job)
    if params.max_tokens is None:  # chat default: the rest of the context
        params.max_tokens = max(1, limits.max_model_len - len(ids))  # min_tokens is checked against it
    validate_request(params, limits, [ids], api=True, ids_from_client=[False])
    return Submission([ids], params, secs, ChatShape(req, state.tokenizer, parse_format))


def _tools(state: ServerState, req: ChatRequest, params, job: dict) -> str | None:
    """Tools go to the chat template; a required or named call is enforced by a grammar. Returns
    the format to parse tool calls from (None: no parsing, as with tool_choice none)."""
    tools = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    template = state.tokenizer.chat_template if state.tokenizer is not None else None
    fmt, forced = check_tools(tools, choice, template)
    if not tools:
        return None
    for i, t in enumerate(tools):  # a schema the grammar engine refuses is a 400 whatever tool_choice says
        if "parameters" in t:
            structured.check(StructuredOutput(json=t["parameters"]), f"tools[{i}].function.parameters")
    job["tools"] = [{"type": "function", "function": t} for t in tools]
    if forced:
        if params.structured is not None:
            raise RequestError("tool_choice forces a tool call and response_format (or a guided field) constrains the "
                               "output too; give one", param="tool_choice")
        limit = forced_call_limit(choice, req.parallel_tool_calls is not False)
        params.structured = forced_call_grammar(fmt, forced, limit)
        structured.check(params.structured, "tool_choice")
    return None if choice == "none" else fmt


# --- response shapes -----------------------------------------------------------------------------
class CompletionShape:
    """`text` choices, the prompt in front when `echo`, legacy logprobs (merged when not streaming)."""

    id_prefix = "cmpl-"
    object_name = "text_completion"

    def __init__(self, req: CompletionRequest, tokenizer, prompts: list[list[int]], skip_special_tokens: bool) -> None:
        self.req, self.tok, self.prompts, self.skip = req, tokenizer, prompts, skip_special_tokens
        self.num_top = req.logprobs or 0
        self.writers: dict[int, CompletionLogprobs] = {}  # per choice: its detokeniser and text offset
        self.parts: dict[int, list[dict]] = {}
        self.started: set[int] = set()
        self._echoed: dict[int, str] = {}

    def chunk(self, rid, model, created, choices, usage_=None):
        return completion_chunk(rid, model, created, choices, usage_)

    def _prompt_text(self, p: int) -> str:
        """The prompt's ids detokenised as the completion is (not the string sent, which lacks an
        added BOS), so with logprobs "".join(tokens) is the returned text."""
        if p not in self._echoed:
            self._echoed[p] = prompt_text(self.tok, self.prompts[p], self.skip)
        return self._echoed[p]

    def _logprobs(self, d: ChoiceDelta) -> dict:
        prompt = self.prompts[d.index // self.req.n]
        w = self.writers.get(d.index)
        if w is None:  # one per choice: its detokeniser follows the choice's tokens across deltas
            w = self.writers[d.index] = CompletionLogprobs(self.tok, prompt, self.skip)
        parts = []
        if d.prompt_logprobs is not None and self.req.echo:  # echo: the prompt's entries come first
            parts.append(w.prompt(prompt, d.prompt_logprobs, self.num_top))
        parts.append(w.add(d.token_ids, d.logprobs, self.num_top, final=d.finish_reason is not None))
        return CompletionLogprobs.merge(parts)

    def stream_choice(self, d: ChoiceDelta) -> dict:
        text = d.text
        if self.req.echo and d.index not in self.started:
            text = self._prompt_text(d.index // self.req.n) + text
        self.started.add(d.index)
        lp = self._logprobs(d) if d.logprobs is not None else None
        return {"index": d.index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason}

    def keep_logprobs(self, d: ChoiceDelta) -> None:
        if d.logprobs is not None:
            self.parts.setdefault(d.index, []).append(self._logprobs(d))

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        if self.req.echo:
            text = self._prompt_text(index // self.req.n) + text
        lp = CompletionLogprobs.merge(self.parts.get(index, [])) if self.req.logprobs is not None else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}


class ChatShape:
    """`delta` choices (role first) when streaming, `message` choices otherwise; chat logprobs."""

    id_prefix = "chatcmpl-"
    object_name = "chat.completion"

    def __init__(self, req: ChatRequest, tokenizer, tool_format: str | None = None) -> None:
        """tool_format: parse the model's tool calls in this format (server/tool_calls.py)."""
        self.req, self.tok, self.tool_format = req, tokenizer, tool_format
        self.num_top = req.top_logprobs or 0
        self.content: dict[int, list[dict]] = {}
        self.started: set[int] = set()
        self.tool_streams: dict[int, ToolCallStream] = {}

    def chunk(self, rid, model, created, choices, usage_=None):
        return chat_chunk(rid, model, created, choices, usage_)

    def _logprobs(self, d: ChoiceDelta) -> list[dict]:
        return format_chat_logprobs(self.tok, d.token_ids, d.logprobs, self.num_top)

    def stream_choice(self, d: ChoiceDelta) -> dict:
        delta: dict = {}
        if d.index not in self.started:
            delta["role"] = "assistant"
            self.started.add(d.index)
        text, finish = d.text, d.finish_reason
        if self.tool_format is not None:
            stream = self.tool_streams.setdefault(d.index, ToolCallStream(self.tool_format))
            text, calls = stream.feed(d.text, final=finish is not None)
            if calls:
                delta["tool_calls"] = calls
            if finish == "stop" and stream.num_calls:
                finish = "tool_calls"
        if text or "role" in delta:
            delta["content"] = text
        lp = {"content": self._logprobs(d)} if d.logprobs is not None and self.req.logprobs else None
        return {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def keep_logprobs(self, d: ChoiceDelta) -> None:
        if d.logprobs is not None:
            self.content.setdefault(d.index, []).extend(self._logprobs(d))

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        lp = {"content": self.content.get(index, [])} if self.req.logprobs else None
        message: dict = {"role": "assistant", "content": text}
        if self.tool_format is not None:
            content, calls = parse_tool_calls(text, self.tool_format)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish_reason}
