"""Tool calling: which format the checkpoint's chat template speaks, the grammar that enforces a
required or named call, and the parser that turns the model's text back into `tool_calls`.

Formats (picked from the chat template, as vLLM's --tool-call-parser names them):
- `hermes` (Hermes, Qwen2/2.5/3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  one block per call; text before the first block is the message content.
- `llama3_json` (Llama 3.1+): the whole message is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`; several calls separated by `;`.
`tool_choice` "required" or a named function is enforced with the structured-output grammar
(protocol/structured.py, engine/grammar.py): the model can only write a well-formed call whose arguments match the
function's JSON schema, and at most the calls forced_call_limit allows (one for a named function), so once the
last is complete the grammar ends the completion itself (finish_reason "tool_calls"). "auto" lets the model
choose and parses what it wrote; "none" parses nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from strata.errors import RequestError
from strata.protocol.sampling_params import StructuredOutput
from strata.protocol.structured import JSON_OPTIONS, close_objects

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_EMPTY_PARAMS = {"type": "object", "properties": {}}
# Parallel calls a "required" grammar allows in one message (a model may end the list sooner)
MAX_PARALLEL_CALLS = 8


def template_format(template: str | None) -> str | None:
    """The tool-call format a chat template renders, or None when it does not render tools."""
    if not template or "tools" not in template:
        return None
    if _OPEN in template:
        return HERMES
    if "ipython" in template or _PYTHON_TAG in template or '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES  # the most common convention for templates that render tools


def new_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex[:24]


def _call_schema(fmt: str, tools: list[dict]) -> dict:
    key = "arguments" if fmt == HERMES else "parameters"
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                key: close_objects(t.get("parameters") or _EMPTY_PARAMS)},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": JSON_OPTIONS}


def forced_call_limit(choice, parallel: bool) -> int:
    """How many calls a forced grammar allows. A named function: one call (as vLLM, whose grammar is
    that function's arguments). "required": one, or with parallel calls up to MAX_PARALLEL_CALLS, so
    the grammar itself ends the completion after the last call it allows: a model that never picks
    the end token after a call (a small or untrained one) would otherwise write calls until
    max_tokens cut one in half, and the message would come back as text with finish_reason "length"."""
    return MAX_PARALLEL_CALLS if choice == "required" and parallel else 1


def forced_call_grammar(fmt: str, tools: list[dict], max_calls: int = 1) -> StructuredOutput:
    """The grammar for tool_choice required (`tools` = all) or named (`tools` = that one): one to
    `max_calls` calls; once the last allowed call is complete only the end remains, and the engine
    stops the sequence there (engine/lifecycle.py, the matcher is_stopped)."""
    body = json.dumps(_call_schema(fmt, tools))
    more = f"{{0,{max_calls - 1}}}" if max_calls > 1 else None
    if fmt == HERMES:
        start = f'start: call ("\\n" call){more}' if more else "start: call"
        return StructuredOutput(grammar=f'{start}\ncall: "{_OPEN}\\n" body "\\n{_CLOSE}"\nbody: %json {body}')
    start = f'start: body (";" body){more}' if more else "start: body"
    return StructuredOutput(grammar=f"{start}\nbody: %json {body}")


def _as_call(obj, fmt: str) -> dict | None:
    """One OpenAI tool call from a parsed JSON object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters")) if fmt == HERMES else obj.get("parameters", obj.get("arguments"))
    if args is None:
        args = {}
    if not isinstance(args, dict | str):
        return None
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": text}}


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished message; text that is not a valid call stays content."""
    if fmt == HERMES:
        calls, first = [], None
        for m in re.finditer(re.escape(_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_CLOSE) + r"|$)", text, re.DOTALL):
            try:
                call = _as_call(json.loads(m.group(1)), fmt)
            except ValueError:
                call = None
            if call is None:
                return text, []  # a malformed block: the message is returned as written
            calls.append(call)
            first = m.start() if first is None else first
        if not calls:
            return text, []
        content = text[:first].strip()
        return content or None, calls
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in _split_calls(body):
        try:
            call = _as_call(json.loads(part), fmt)
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _split_calls(body: str) -> list[str]:
    """`{...}; {...}` -> its objects (a `;` inside a string does not split)."""
    dec, parts, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            _, end = dec.raw_decode(body, i)
        except ValueError:
            return [body]
        parts.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return parts


@dataclass
class ToolCallStream:
    """Streaming: content deltas pass through until a call begins; each call is sent whole, as one
    `tool_calls` delta, once its block is complete (or at the end of the message)."""

    fmt: str
    buffer: str = ""
    inside: bool = False  # hermes: between <tool_call> and </tool_call>
    held: bool | None = None  # llama3_json: None until the first non-space text decides
    num_calls: int = 0
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, complete calls to send now)."""
        self.buffer += text
        out = self._hermes(final) if self.fmt == HERMES else self._llama(final)
        for c in out[1]:
            c["index"] = self.num_calls
            self.num_calls += 1
        return out

    def _hermes(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(_OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, _OPEN)
                    cut = len(self.buffer) - keep
                    content += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    return content, calls
                content += self.buffer[:at]
                self.buffer = self.buffer[at + len(_OPEN):]
                self.inside = True
            end = self.buffer.find(_CLOSE)
            if end < 0 and not final:
                return content, calls
            block = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(_CLOSE):].lstrip("\n")
            self.inside = False
            try:
                call = _as_call(json.loads(block), self.fmt)
            except ValueError:
                call = None
            if call is None:
                content += _OPEN + block + ("" if end < 0 else _CLOSE)
            else:
                calls.append(call)
            if end < 0:
                return content, calls

    def _llama(self, final: bool) -> tuple[str, list[dict]]:
        if self.held is None:
            head = self.buffer.lstrip()
            if not head and not final:
                return "", []
            self.held = head.startswith("{") or head.startswith(_PYTHON_TAG) or (
                not final and _PYTHON_TAG.startswith(head))
        if not self.held:
            text, self.buffer = self.buffer, ""
            return text, []
        if not final:
            return "", []
        text, self.buffer = self.buffer, ""
        content, calls = parse_tool_calls(text, self.fmt)
        return (content or "") if not calls else "", calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def check_tools(tools: list[dict], choice, template: str | None) -> tuple[str | None, list[dict]]:
    """(format, the tools a forced call may use) for a request; RequestError when they cannot work."""
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("tool_choice needs tools; give tools or drop tool_choice", param="tool_choice")
        return None, []
    fmt = template_format(template)
    if fmt is None:
        raise RequestError("this model's chat template does not render tools (it never reads the `tools` "
                           "variable); serve it with --chat-template set to one that does, or drop tools",
                           param="tools")
    names = [t["name"] for t in tools]
    for i, name in enumerate(names):
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise RequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                               param=f"tools[{i}].function.name")
    if len(set(names)) != len(names):
        raise RequestError("tools: function names must be unique", param="tools")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise RequestError(f"tool_choice names {name!r}, which is not among tools ({', '.join(names)})",
                               param="tool_choice.function.name")
        return fmt, [t for t in tools if t["name"] == name]
    return fmt, (tools if choice == "required" else [])
