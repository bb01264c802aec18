"""A safetensors file read with plain reads, tensor by tensor or a few rows at a time.

The safetensors library maps the whole file; every page a tensor read touches then counts in the
process's RSS until the file is closed, so a 5 GB shard adds up to 5 GB to the load peak on top of
the weights being filled. Here the header (8-byte little-endian length + JSON, nothing executable)
is parsed and checked once, and each read lands in a buffer the caller owns: the destination
itself where its dtype matches, else a chunk of rows converted on the way in.
"""

from __future__ import annotations

import json
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
        return ModelLoadError(f"{self.path}: corrupt or truncated safetensors file ({why}); re-download or re-save it")

    def _read_header(self) -> tuple[dict, int]:
        size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, 8, 0)
        if len(raw) < 8:
            raise self._corrupt("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise self._corrupt(f"header length {n} runs past the file's {size} bytes")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._corrupt(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._corrupt("header is not a JSON object")
        header.pop("__metadata__", None)
        data_start, data_size = 8 + n, size - 8 - n
        entries = {}
        for name, e in header.items():
            try:
                dtype = DTYPES[e["dtype"]]
                shape = tuple(int(d) for d in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._corrupt(f"tensor {name!r} has a malformed entry {e!r}") from None
            numel = int(np.prod(shape, dtype=np.int64))
            if min(shape, default=0) < 0 or end - begin != numel * dtype.itemsize or begin < 0:
                raise self._corrupt(f"tensor {name!r}: offsets {begin}-{end} do not fit shape {list(shape)}")
            if end > data_size:
                raise self._corrupt(f"tensor {name!r} ends at byte {end} of a {data_size}-byte data section")
            entries[name] = (dtype, shape, begin)
        return entries, data_start

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
