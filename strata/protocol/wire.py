"""Messages between the server's processes: msgpack over ZeroMQ, never pickle.

Front end -> engine:   {"op": "add", "id", "prompt_ids", "params"}, {"op": "abort", "ids"},
                       {"op": "finish_seq", "id", "index", "stop"}, {"op": "shutdown"}
Engine -> front end:   {"op": "ready", "info"}, {"op": "fatal", "message"},
                       {"op": "step", "deltas", "done", "errors", "stats"}
Front end <-> tokenizer worker: {"job", "kind": "text"|"chat", ...} -> {"job", "ids"} | {"job", "error"}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from strata.protocol.sampling_params import SamplingParams

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(msg: dict[str, Any]) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> dict[str, Any]:
    msg = _decoder.decode(data)
    if not isinstance(msg, dict):
        raise ValueError(f"expected a msgpack map, got {type(msg).__name__}")
    return msg


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in _PARAM_FIELDS}


def params_from_dict(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: v for k, v in d.items() if k in _PARAM_FIELDS})
