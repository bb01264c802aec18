"""The structured-output request check: a StructuredOutput -> its llguidance grammar, compile-checked.

Needs no tokenizer and no torch, so the server's front end refuses a bad schema, regex or grammar
with a 400 before any stream starts (server/structured_api.py), and the engine compiles the same
grammar text against the checkpoint's tokenizer (engine/grammar.py, GrammarCompiler). The JSON
choices (compact separators, closed objects) are documented in engine/grammar.py.
"""

from __future__ import annotations

import json

from strata.errors import RequestError
from strata.protocol.sampling_params import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# JSON-schema keywords whose value is a schema, a list of schemas, or a map of name -> schema
_SCHEMA_KEYS = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
                "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema):
    """A copy of `schema` where every object schema that does not say `additionalProperties`
    forbids extra properties (walks the keywords that hold schemas, never property names)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or ("type" not in out and "properties" in out)
    if is_object and "additionalProperties" not in out and "patternProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def load_llguidance():
    try:
        import llguidance
    except ImportError as e:  # a declared dependency; only a broken install lacks it
        raise RequestError(f"structured output needs the llguidance package ({e}); pip install llguidance") from None
    return llguidance


def grammar_text(so: StructuredOutput, param: str = "structured") -> str:
    """The llguidance grammar (its JSON form) for `so`; RequestError naming `param` if malformed."""
    M = load_llguidance().LLMatcher
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise RequestError(f"{param}: the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, dict | bool):
            raise RequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
        return M.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
    if so.json_object:
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.regex is not None:
        return M.grammar_from_regex(so.regex)
    if so.choice is not None:
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    return M.grammar_from_lark(so.grammar)


def unusable(so: StructuredOutput, param: str, error: str) -> RequestError:
    """llguidance's first line of complaint, under the field the user set."""
    kind = so.kinds()[0].replace("_", " ")
    return RequestError(f"{param}: the {kind} cannot be used: {error.strip().splitlines()[0]}", param=param)


def check(so: StructuredOutput, param: str = "structured", tokenizer=None) -> str:
    """Compile-check `so` (no tokenizer needed: the front end calls this); returns the grammar."""
    so.validate(param)
    text = grammar_text(so, param)
    error = load_llguidance().LLMatcher.validate_grammar(text, tokenizer)
    if error and not error.startswith("WARNING"):
        raise unusable(so, param, error)
    return text
