"""A GGUF file (llama.cpp's format) parsed with every offset, size and count checked first.

Layout (GGUF v2/v3): magic "GGUF", version, tensor count, metadata count; the metadata
(key, typed value; arrays of values); one info per tensor (name, dims innermost first, ggml type,
offset into the data section); the data section at the next `general.alignment` boundary.

Every length read from the file is checked against the bytes the file still has before anything
is allocated for it (the GGUF loader overflow CVEs of 2024-25 came from trusting these counts):
a string or array cannot claim more bytes than remain, a tensor's dimensions and type must give
a size that fits the data section, tensors may not overlap, names and keys may not repeat. Any
violation is a one-line ModelLoadError naming the file, the field and the value. Tensor data is
read with plain preads into buffers the caller owns (as graph/safetensors_file.py does), never
a whole-file mapping. The ggml type table (block size, bytes per block) is the `gguf` package's.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.errors import ModelLoadError
from strata.graph.pread_file import PreadFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # a tensor of more elements is absurd (Llama-3.1-405B's largest: 2^31)
_CHUNK = 1 << 20

# metadata value types: struct format (fixed-size ones) by type id
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: outermost first (rows, columns for a matrix)
    offset: int  # absolute, in the file
    nbytes: int
    path: Path

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.type]
        return self.shape[-1] // block * size


class GGUFFile(PreadFile):
    """One .gguf file: `metadata` (key -> value), `tensors` (name -> TensorInfo), `read(info, a, b)`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            self.size = os.fstat(self._fd).st_size
            self._buf, self._buf_at, self._pos = b"", 0, 0
            self.metadata, self.tensors = self._parse()
        except BaseException:
            os.close(self._fd)
            raise
        self._buf = b""

    # --- bounded reads of the header ----------------------------------------------------------

    def _bad(self, field: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: corrupt or unsupported GGUF file: {field}: {why}; "
                              "re-download the file or re-convert it with llama.cpp's tools")

    def _take(self, n: int, field: str) -> bytes:
        if n > self.size - self._pos:
            raise self._bad(field, f"needs {n:,} bytes at offset {self._pos:,}, but the file has "
                                   f"{self.size:,} bytes (truncated?)")
        start = self._pos - self._buf_at
        if start + n > len(self._buf):  # refill: what is left of the buffer plus a chunk
            self._buf = os.pread(self._fd, max(n, _CHUNK), self._pos)
            self._buf_at, start = self._pos, 0
            if len(self._buf) < n:
                raise self._bad(field, f"the file ends at offset {self._pos + len(self._buf):,}")
        self._pos += n
        return self._buf[start:start + n]

    def _scalar(self, fmt: str, field: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), field))[0]

    def _string(self, field: str) -> str:
        n = self._scalar("<Q", field + " (length)")
        raw = self._take(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._bad(field, "is not UTF-8") from None

    def _value(self, kind: int, field: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind], field)
        if kind == _STRING:
            return self._string(field)
        if kind == _ARRAY and depth == 0:
            item = self._scalar("<I", field + " (array type)")
            count = self._scalar("<Q", field + " (array length)")
            least = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8 if item in (_STRING, _ARRAY) else 0
            if not least:
                raise self._bad(field, f"array of unknown value type {item}")
            if count * least > self.size - self._pos:
                raise self._bad(field, f"array of {count:,} items cannot fit in the {self.size - self._pos:,} "
                                       "bytes left in the file")
            if item in _SCALARS:  # one unpack for the whole run
                fmt = _SCALARS[item]
                raw = self._take(count * least, field)
                return list(struct.unpack(f"<{count}{fmt[1]}", raw))
            return [self._value(item, f"{field}[{i}]", depth + 1) for i in range(count)]
        raise self._bad(field, f"unknown value type {kind}" + (" (nested array)" if kind == _ARRAY else ""))

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        magic = self._take(4, "magic")
        if magic != MAGIC:
            raise self._bad("magic", f"{magic!r} is not b'GGUF' (not a GGUF file)")
        version = self._scalar("<I", "version")
        if version not in VERSIONS:
            raise self._bad("version", f"{version} (Strata reads GGUF versions {VERSIONS})")
        n_tensors = self._scalar("<Q", "tensor_count")
        n_kv = self._scalar("<Q", "metadata_kv_count")
        # each KV takes >= 8 (key length) + 4 (type) + 1 bytes; each tensor info >= 8 + 4 + 4 + 8
        if n_kv * 13 > self.size or n_tensors * 24 > self.size:
            raise self._bad("tensor_count / metadata_kv_count",
                            f"{n_tensors:,} tensors / {n_kv:,} keys cannot fit in {self.size:,} bytes")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self._string(f"metadata key {i}")
            if key in metadata:
                raise self._bad(f"metadata key {key!r}", "appears twice")
            field = f"metadata {key[:80]!r}"
            metadata[key] = self._value(self._scalar("<I", f"{field} (type)"), field)
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self._bad("general.alignment", f"{alignment!r} is not a power of two")
        infos: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = self._string(f"tensor {i} name")
            if name in names:
                raise self._bad(f"tensor {name!r}", "appears twice")
            names.add(name)
            n_dims = self._scalar("<I", f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self._bad(f"tensor {name!r} n_dims", f"{n_dims} (expected 1-{MAX_DIMS})")
            dims = [self._scalar("<Q", f"tensor {name!r} dims") for _ in range(n_dims)]
            kind = self._scalar("<I", f"tensor {name!r} type")
            offset = self._scalar("<Q", f"tensor {name!r} offset")
            try:
                gtype = GGMLQuantizationType(kind)
                block = GGML_QUANT_SIZES[gtype][0]
            except (ValueError, KeyError):
                raise self._bad(f"tensor {name!r} type", f"unknown ggml type {kind}") from None
            if any(d <= 0 for d in dims) or int(np.prod(dims, dtype=np.float64)) > MAX_ELEMENTS:
                raise self._bad(f"tensor {name!r} dims", f"{dims} (each must be >= 1, at most {MAX_ELEMENTS:,} elements)")
            if dims[0] % block:
                raise self._bad(f"tensor {name!r} dims", f"row length {dims[0]} is not a multiple of "
                                                         f"{gtype.name}'s block of {block}")
            infos.append((name, gtype, tuple(reversed(dims)), offset))
        data_start = -(-self._pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, gtype, shape, offset in infos:
            block, size = GGML_QUANT_SIZES[gtype]
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size
            begin = data_start + offset
            if offset % alignment or begin + nbytes > self.size:
                raise self._bad(f"tensor {name!r} offset", f"{offset:,} (+{nbytes:,} bytes) is misaligned or runs "
                                                           f"past the end of the {self.size:,}-byte file")
            tensors[name] = TensorInfo(name, gtype, shape, begin, nbytes, self.path)
        spans = sorted(tensors.values(), key=lambda t: t.offset)
        for a, b in zip(spans, spans[1:]):
            if a.offset + a.nbytes > b.offset:
                raise self._bad(f"tensor {b.name!r} offset", f"overlaps tensor {a.name!r}")
        return metadata, tensors

    # --- tensor data ----------------------------------------------------------------------------

    def read(self, info: TensorInfo, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (its first dimension; a 1-D tensor is one row) as raw
        bytes, uint8 [stop - start, row_bytes] (into `out` when given)."""
        rows = 1 if len(info.shape) == 1 else int(np.prod(info.shape[:-1], dtype=np.int64))
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"rows {start}-{stop} of a {rows}-row tensor")
        row = info.row_bytes if len(info.shape) > 1 else info.nbytes
        if out is None:
            out = np.empty((stop - start, row), np.uint8)
        self._read_into(out, info.offset + start * row, info.name)
        return out


def split_files(path: Path) -> list[Path]:
    """The files of a model: `path` alone, or every `-0000k-of-0000N.gguf` sibling of a split."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{path}: split GGUF part(s) {', '.join(missing)} missing beside it "
                             f"(a split model needs all {count} files in one directory)")
    return files
