"""The GGUF parser refuses a malformed file with one ModelLoadError naming the field, before
allocating anything for it (graph/gguf_file.py), and never crashes on random headers."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata.errors import ModelLoadError
from strata.graph.gguf_file import GGUFFile


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _header(tensors: int, kvs: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def _write(tmp_path, data: bytes):
    p = tmp_path / "x.gguf"
    p.write_bytes(data)
    return p


def _refused(path, *words):
    with pytest.raises(ModelLoadError) as e:
        GGUFFile(path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg
    for w in words:
        assert w in msg, msg


def _valid(tmp_path):
    p = tmp_path / "ok.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def test_a_valid_file_reads(tmp_path):
    with GGUFFile(_valid(tmp_path)) as g:
        assert g.metadata["llama.block_count"] == 1
        info = g.tensors["a.weight"]
        assert info.shape == (2, 32) and info.type.name == "F32"
        assert (g.read(info, 1, 2).view(np.float32) == np.arange(32, 64)).all()


def test_bad_magic_and_version(tmp_path):
    _refused(_write(tmp_path, b"GGML" + b"\0" * 40), "magic")
    _refused(_write(tmp_path, _header(0, 0, version=9)), "version", "9")


def test_a_string_longer_than_the_file(tmp_path):
    data = _header(0, 1) + struct.pack("<Q", 1 << 40) + b"key"
    _refused(_write(tmp_path, data), "metadata key 0", "1,099,511,627,776")


def test_an_array_count_past_the_file(tmp_path):
    data = _header(0, 1) + _string(b"k") + struct.pack("<IIQ", 9, 4, 1 << 50)
    _refused(_write(tmp_path, data), "'k'", "array")


def test_absurd_counts(tmp_path):
    _refused(_write(tmp_path, _header(1 << 60, 0)), "tensor_count")


def test_truncated_file(tmp_path):
    raw = _valid(tmp_path).read_bytes()
    _refused(_write(tmp_path, raw[: len(raw) - 16]), "b.weight")
    _refused(_write(tmp_path, raw[:30]))


def test_unknown_tensor_type_and_bad_dims(tmp_path):
    def tensor(dims, kind, offset=0):
        return _header(1, 0) + _string(b"t") + struct.pack("<I", len(dims)) + b"".join(
            struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset) + b"\0" * 256
    _refused(_write(tmp_path, tensor([32], 999)), "type", "999")
    _refused(_write(tmp_path, tensor([0], 0)), "dims")
    _refused(_write(tmp_path, tensor([1 << 31, 1 << 31], 0)), "dims")
    _refused(_write(tmp_path, tensor([33], 8)), "block")  # Q8_0 rows are multiples of 32
    _refused(_write(tmp_path, tensor([32, 1 << 20], 0)), "offset")  # runs past the end


def test_overlapping_tensors(tmp_path):
    body = b""
    for name in (b"a", b"b"):
        body += _string(name) + struct.pack("<IQ", 1, 32) + struct.pack("<IQ", 0, 0)
    data = _header(2, 0) + body
    data += b"\0" * (-len(data) % 32) + b"\0" * 256
    _refused(_write(tmp_path, data), "overlaps")


def test_duplicate_keys_and_names(tmp_path):
    kv = _string(b"k") + struct.pack("<IB", 0, 1)
    _refused(_write(tmp_path, _header(0, 2) + kv + kv), "twice")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_headers_never_crash(tmp_path, data):
    """Random bytes after a real header prefix: either parsed or a ModelLoadError, nothing else."""
    raw = _valid(tmp_path).read_bytes() if not hasattr(test_fuzzed_headers_never_crash, "raw") else test_fuzzed_headers_never_crash.raw
    test_fuzzed_headers_never_crash.raw = raw
    cut = data.draw(st.integers(5, len(raw)))
    flips = data.draw(st.lists(st.tuples(st.integers(4, cut - 1), st.integers(0, 255)), max_size=8))
    mutated = bytearray(raw[:cut])
    for at, value in flips:
        mutated[at] = value
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(bytes(mutated))
    try:
        GGUFFile(p).close()
    except ModelLoadError:
        pass
