"""Keep numba's on-disk cache of the kernels true to their sources.

numba checks a cached function against its own file only, yet a compiled function carries the
code of every njit function it calls: after cpu_attention.py changed, cpu_decode_layer._layer's
cached copy kept running the old attention (numba's documented cache-invalidation limit). So the
package's __pycache__ holds a stamp, a hash of every kernel source file; when the sources no
longer match it, the cached kernels are deleted before any is loaded and compile afresh once.
numba tolerates entries vanishing under a running process (a missing file is a cache miss).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

_HERE = Path(__file__).parent
_STAMP = "numba-sources.sha256"


def sources_hash(directory: Path = _HERE) -> str:
    h = hashlib.sha256()
    for f in sorted(directory.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def clear_if_sources_changed(directory: Path = _HERE) -> bool:
    """Delete the directory's cached numba kernels (__pycache__/*.nbi, *.nbc) when its sources
    changed since the stamp was written; True when it did. A read-only install is left alone."""
    cache = directory / "__pycache__"
    stamp = cache / _STAMP
    digest = sources_hash(directory)
    with contextlib.suppress(OSError):
        if stamp.read_text() == digest:
            return False
    try:
        cache.mkdir(exist_ok=True)
        for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            with contextlib.suppress(FileNotFoundError):  # another process got there first
                f.unlink()
        stamp.write_text(digest)
    except OSError:  # not writable: numba does not cache here either
        return False
    return True
