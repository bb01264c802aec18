"""A safetensors file read with plain reads, tensor by tensor or a few rows at a time.

The safetensors library maps the whole file; every page a tensor read touches then counts in the
process's RSS until the file is closed, so a 5 GB shard adds up to 5 GB to the load peak on top of
the weights being filled. Here the header (8-byte little-endian length + JSON, nothing executable)
is parsed and checked once, and each read lands in a buffer the caller owns: the destination
itself where its dtype matches, else a chunk of rows converted on the way in.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from strata.errors import ModelLoadError
from strata.graph.pread_file import PreadFile

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100 << 20  # the safetensors format's own limit
FIX = "the file is corrupt or was edited; re-download or re-convert it"


class SafetensorsFile(PreadFile):
    """One .safetensors file: `names()`, `shape(name)`, `dtype(name)`, `read_rows(name, a, b, out)`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self._entries, self._data_start = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _corrupt(self, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: bad safetensors file: {why}; {FIX}")

    def _read_header(self) -> tuple[dict, int]:
        """Parse and check the whole header before any tensor byte is read: a header that lies
        about a tensor's bytes would otherwise load garbage (or another tensor's bytes) silently."""
        size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, 8, 0)
        if len(raw) < 8:
            raise self._corrupt("shorter than its 8-byte header length (truncated)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise self._corrupt(f"header length {n} runs past the file's {size} bytes (truncated)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._corrupt(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        header.pop("__metadata__", None)
        data_size = size - 8 - n
        entries = {name: self._entry(name, e, data_size) for name, e in header.items()}
        self._check_no_overlap(entries)
        return entries, 8 + n

    def _entry(self, name: str, e: object, data_size: int) -> tuple[torch.dtype, tuple[int, ...], int]:
        """(dtype, shape, begin) of one header entry, once its data_offsets are proven to be
        exactly its dtype x shape bytes inside the data section."""
        try:
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(d) for d in e["shape"])
            begin, end = (int(o) for o in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise self._corrupt(f"tensor {name!r} has a malformed entry {e!r}") from None
        says = f"tensor {name!r}: the header says {e['dtype']} {list(shape)} at data_offsets [{begin}, {end})"
        if min(shape, default=0) < 0:
            raise self._corrupt(f"{says}, but a shape cannot have a negative dimension")
        if begin > end:
            raise self._corrupt(f"{says}, but begin {begin} is after end {end} (begin must be <= end)")
        if begin < 0 or end > data_size:
            raise self._corrupt(f"{says}, but the data section holds bytes [0, {data_size}) "
                                f"(the offsets must lie within it)")
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise self._corrupt(f"{says} = {end - begin} bytes, but {math.prod(shape)} {e['dtype']} elements "
                                f"take {want} bytes (data_offsets should be [{begin}, {begin + want}))")
        return dtype, shape, begin

    def _check_no_overlap(self, entries: dict) -> None:
        """Each tensor's bytes are its own: two tensors reading the same bytes means an edited header.
        (Sorted by begin, any overlap shows between neighbours.)"""
        spans = sorted((b, b + math.prod(shape) * dtype.itemsize, k) for k, (dtype, shape, b) in entries.items())
        spans = [s for s in spans if s[1] > s[0]]  # an empty tensor holds no bytes to share
        for (b0, e0, a), (b1, e1, b) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._corrupt(f"tensors {a!r} at data_offsets [{b0}, {e0}) and {b!r} at [{b1}, {e1}) "
                                    f"overlap (each tensor must own its bytes)")

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][0]

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (along its first dimension; a 0-d or 1-d tensor reads
        whole with start=0, stop=len). `out`: a contiguous CPU tensor of the file's dtype and the
        rows' shape to read into (no other copy); else a fresh one."""
        dtype, shape, begin = self._entries[name]
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        rows_shape = (stop - start, *shape[1:]) if shape else ()
        if out is None:
            out = torch.empty(rows_shape, dtype=dtype)
        self._read_into(out.reshape(-1).view(torch.uint8).numpy(), self._data_start + begin + start * row, name)
        return out

    def _cut_short(self, name: str) -> ModelLoadError:
        return self._corrupt(f"tensor {name!r} is cut short")
