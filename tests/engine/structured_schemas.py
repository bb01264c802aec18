"""Hypothesis strategies for JSON schemas: objects, arrays, enums, bounded numbers, required
fields, nesting (a plain module the structured-output tests import)."""

from __future__ import annotations

from hypothesis import strategies as st

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


@st.composite
def _string(draw):
    lo = draw(st.integers(0, 4))
    return {"type": "string", "minLength": lo, "maxLength": lo + draw(st.integers(0, 12))}


@st.composite
def _integer(draw):
    lo = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": lo, "maximum": lo + draw(st.integers(0, 5000))}


@st.composite
def _number(draw):
    lo = draw(st.integers(-100, 100)) / 4
    return {"type": "number", "minimum": lo, "maximum": lo + draw(st.integers(1, 400)) / 4}


_enum = st.lists(
    st.one_of(st.text(alphabet="abcdefgh XYZ-", min_size=1, max_size=6), st.integers(-50, 50), st.booleans(),
              st.none()),
    min_size=1, max_size=5, unique_by=lambda v: (type(v).__name__, v),
).map(lambda values: {"enum": values})

_leaf = st.one_of(_string(), _integer(), _number(), st.just({"type": "boolean"}), st.just({"type": "null"}), _enum)


def _array(items):
    @st.composite
    def build(draw):
        lo = draw(st.integers(0, 2))
        return {"type": "array", "items": draw(items), "minItems": lo, "maxItems": lo + draw(st.integers(0, 3))}

    return build()


def _object(values):
    @st.composite
    def build(draw):
        props = draw(st.dictionaries(_names, values, min_size=1, max_size=4))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
        schema = {"type": "object", "properties": props, "required": required}
        return schema

    return build()


schemas = st.recursive(_leaf, lambda inner: st.one_of(_array(inner), _object(inner)), max_leaves=8)
object_schemas = _object(schemas)
