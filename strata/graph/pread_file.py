"""What the checkpoint readers (safetensors_file.py, gguf_file.py) share: a file read with plain
preads into buffers the caller owns (no whole-file mapping: mapped pages would count in RSS until
the file closes), and the chunk of rows a converting read handles at a time."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from strata.errors import ModelLoadError

# Rows read at a time where a tensor is converted on the way in (bounds the load's temporaries)
READ_CHUNK_BYTES = 16 << 20


class PreadFile:
    """An open file descriptor, closed by close() or the context manager."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise ModelLoadError(f"{self.path}: cannot open ({e})") from None

    def _cut_short(self, name: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: tensor {name!r} is cut short")

    def _read_into(self, out: np.ndarray, offset: int, name: str) -> None:
        """Fill `out` (contiguous) with the file's bytes from `offset`."""
        view = memoryview(out.reshape(-1).view(np.uint8)).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise self._cut_short(name)
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
