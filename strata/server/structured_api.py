"""The request fields that constrain a completion -> one StructuredOutput, checked in the front end.

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), llama-server's
`{"type": "json_object", "schema": {...}}`, and vLLM's `structured_outputs` ({json, regex,
choice, grammar, json_object}) and older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. At most one of them may constrain a request. The grammar is compiled here once
without a tokenizer (protocol/structured.check), so a bad schema is a 400 before any stream starts.
"""

from __future__ import annotations

from typing import Any

from strata.errors import RequestError
from strata.protocol import structured
from strata.protocol.sampling_params import STRUCTURED_KINDS, StructuredOutput

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _from_response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict):
        raise RequestError("response_format must be an object such as {\"type\": \"json_object\"}",
                           param="response_format")
    kind = rf.get("type")
    extra = sorted(set(rf) - {"type", "json_schema", "schema"})
    if extra:
        raise RequestError(f"response_format: unknown field {extra[0]!r}", param=f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also takes a schema here
        if "schema" in rf:
            return StructuredOutput(json=rf["schema"])
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("response_format.json_schema must be an object with the schema in its `schema` "
                               "field", param="response_format.json_schema")
        extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
        if extra:
            raise RequestError(f"response_format.json_schema: unknown field {extra[0]!r}",
                               param=f"response_format.json_schema.{extra[0]}")
        schema = spec.get("schema")
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            return StructuredOutput(json_object=True)
        return StructuredOutput(json=schema)
    raise RequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format.type")


def structured_output(fields: dict[str, Any]) -> tuple[StructuredOutput | None, str]:
    """(the request's constraint or None, the field it came from), compile-checked."""
    found: list[tuple[StructuredOutput, str]] = []
    if fields.get("response_format") is not None:
        so = _from_response_format(fields["response_format"])
        if so is not None:
            found.append((so, "response_format"))
    so_fields = fields.get("structured_outputs")
    if so_fields is not None:
        if not isinstance(so_fields, dict) or sorted(set(so_fields) - set(STRUCTURED_KINDS)):
            raise RequestError(f"structured_outputs must be an object with one of {', '.join(STRUCTURED_KINDS)}",
                               param="structured_outputs")
        found.append((StructuredOutput(**so_fields), "structured_outputs"))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            found.append((StructuredOutput(**{kind: fields[name]}), name))
    if not found:
        return None, ""
    if len(found) > 1:
        names = [param for _, param in found]
        raise RequestError(f"{names[0]} and {names[1]} both constrain the output; give one", param=names[1])
    so, param = found[0]
    structured.check(so, param)
    return so, param
