"""SamplingParams: vLLM-shaped per-request generation settings, validated before any work.

`validate` is the one place a value is judged, for the offline API (`LLM.generate` calls it
through the engine) and the server alike (after its own type checks): a bad value is a
RequestError (a ValueError) naming the field. Integers must be real ints (not bools), floats
finite numbers; the limits below are the documented bounds.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from strata.errors import RequestError

MAX_N = 128  # completions per prompt in one request (n)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed; what the server's msgpack messages carry
MAX_TOP_K = 2**31 - 1  # top_k beyond the vocabulary keeps every token
MAX_TOKENS_LIMIT = INT64_MAX  # max_tokens / min_tokens (the context length is checked separately)
MIN_DIVISOR = 1e-6  # least temperature > 0 and repetition_penalty: the fp32 sampler divides by them,
# and far below this (~1e-37) the quotient overflows and sampling returns token 0


def is_int(v: object) -> bool:
    """A real integer: bool is an int subclass in Python but never a count or an id here."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v: object) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite once a float."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int too large for a float
        return False


def _show(v: object) -> str:
    """repr for an error message: short, and safe for ints too long for str()."""
    if is_int(v) and v.bit_length() > 256:
        return f"an integer of {v.bit_length()} bits"
    if isinstance(v, list):
        v = [x if not is_int(x) or x.bit_length() <= 256 else _show(x) for x in v[:20]]
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."


class RequestOutputKind(enum.IntEnum):
    """What the engine returns for a request as it runs (vLLM's names): CUMULATIVE, an output
    after every step with all text and tokens so far; FINAL_ONLY, one output when it finishes
    (LLM.generate asks for it: it reads nothing else, and a sequence without stop strings is then
    detokenised once, at its end, instead of token by token). DELTA is not implemented."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """Constrain a completion (exactly one field set): `json` a JSON schema (dict or its JSON text),
    `json_object` any JSON object, `regex` a regular expression (Rust regex syntax), `choice` one of
    these strings, `grammar` a Lark grammar as llguidance reads it. The completion stops when the
    grammar is complete. vLLM's StructuredOutputsParams / GuidedDecodingParams, same field names."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kinds(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    def validate(self, param: str = "structured", prefix: str = "") -> None:
        """Raise RequestError naming `param` (the field the user set: structured, response_format)."""

        def bad(msg: str) -> RequestError:
            return RequestError(f"{prefix}{param}: {msg}", param=param)

        kinds = self.kinds()
        if len(kinds) != 1:
            raise bad(f"set exactly one of {', '.join(STRUCTURED_KINDS)}, got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise bad("json must be a JSON schema (an object, or its JSON text)")
        if not isinstance(self.json_object, bool):
            raise bad("json_object must be true or false")
        if self.regex is not None and not isinstance(self.regex, str):
            raise bad("regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise bad("grammar must be a Lark grammar (a string)")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise bad("choice must be a non-empty list of non-empty strings")


def _structured(value: object) -> object:
    """A dict (the wire form, or a user's) becomes StructuredOutput; anything else is judged later."""
    if isinstance(value, dict) and set(value) <= {f for f in StructuredOutput.__dataclass_fields__}:
        return StructuredOutput(**value)
    return value


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, on prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI-style, on output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (the first has none)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # constrained decoding (protocol/structured.py, engine/grammar.py)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # FINAL_ONLY: LLM.generate's

    def __post_init__(self) -> None:
        # Normalise only; never raise here, so a bad value is reported by validate() with the
        # request index (LLM.generate validates every request before any work).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, list | tuple):
            self.stop = list(self.stop)
        self.structured = _structured(self.structured)
        if is_int(self.output_kind) and self.output_kind in (0, 1, 2):  # an int from a msgpack message
            self.output_kind = RequestOutputKind(self.output_kind)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, index: int = 0, vocab_size: int | None = None) -> None:
        """Raise RequestError naming the request index and the field."""

        def bad(name: str, msg: str) -> RequestError:
            return RequestError(f"request {index}: {name} {msg}, got {_show(getattr(self, name))}", param=name)

        def number_in(name: str, ok, rule: str) -> None:
            v = getattr(self, name)
            if not is_finite_number(v) or not ok(v):
                raise bad(name, f"must be a finite number {rule}")

        def int_in(name: str, lo: int, hi: int, rule: str) -> None:
            v = getattr(self, name)
            if not is_int(v) or not lo <= v <= hi:
                raise bad(name, f"must be an integer {rule}")

        int_in("n", 1, MAX_N, f">= 1 and <= {MAX_N} (Strata's limit on completions per request)")
        number_in("temperature", lambda v: v == 0 or v >= MIN_DIVISOR, f"that is 0 (greedy) or >= {MIN_DIVISOR:g}")
        number_in("top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        v = self.top_k
        if not is_int(v) or not (v == -1 or 1 <= v <= MAX_TOP_K):
            raise bad("top_k", f"must be -1 (disabled) or an integer in [1, {MAX_TOP_K}]")
        number_in("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        number_in("repetition_penalty", lambda v: v >= MIN_DIVISOR, f">= {MIN_DIVISOR:g} (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            number_in(name, lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
        if self.max_tokens is not None:
            int_in("max_tokens", 1, MAX_TOKENS_LIMIT, ">= 1 (and < 2**63)")
        int_in("min_tokens", 0, MAX_TOKENS_LIMIT, ">= 0 (and < 2**63)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            int_in("seed", INT64_MIN, INT64_MAX, "that fits in 64 bits (signed)")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                top = vocab_size if vocab_size is not None else INT64_MAX
                int_in(name, 0, top, f">= 0{f' and <= the vocabulary size ({vocab_size})' if vocab_size else ''}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not isinstance(self.stop_token_ids, list):
            raise bad("stop_token_ids", "must be a list of token ids")
        top_id = vocab_size if vocab_size is not None else INT64_MAX
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0 or t >= top_id:
                raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be RequestOutputKind.CUMULATIVE or FINAL_ONLY")
        if self.output_kind is RequestOutputKind.DELTA:
            raise RequestError(f"request {index}: output_kind DELTA is not implemented; use CUMULATIVE (every "
                               "output carries the text so far) or FINAL_ONLY", param="output_kind")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad("structured", "must be a StructuredOutput (or a dict of its fields: "
                          f"{', '.join(STRUCTURED_KINDS)})")
            self.structured.validate("structured", f"request {index}: ")
