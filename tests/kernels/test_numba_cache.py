"""The kernels' numba cache is cleared when any kernel source changes (numba itself checks only
the cached function's own file, so a caller would keep a changed callee's old code)."""

from strata.kernels.numba_cache import clear_if_sources_changed


def _cached_entries(cache):
    return sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc"))


def test_cached_kernels_are_deleted_when_a_source_changes(tmp_path):
    (tmp_path / "caller.py").write_text("def f(): return g()\n")
    (tmp_path / "callee.py").write_text("def g(): return 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    for name in ("caller.f-1.py311.nbi", "caller.f-1.py311.1.nbc", "keep.pyc"):
        (cache / name).write_bytes(b"x")

    assert clear_if_sources_changed(tmp_path)  # no stamp yet: whatever is cached is of unknown sources
    assert _cached_entries(cache) == [] and (cache / "keep.pyc").exists()

    (cache / "caller.f-1.py311.nbi").write_bytes(b"x")  # compiled again against these sources
    assert not clear_if_sources_changed(tmp_path)
    assert _cached_entries(cache) == ["caller.f-1.py311.nbi"]

    (tmp_path / "callee.py").write_text("def g(): return 2\n")  # only the callee's file changes
    assert clear_if_sources_changed(tmp_path)
    assert _cached_entries(cache) == []
    assert not clear_if_sources_changed(tmp_path)


def test_a_read_only_cache_is_left_alone(tmp_path):
    (tmp_path / "k.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").write_text("not a directory")  # cannot hold a stamp
    assert not clear_if_sources_changed(tmp_path)
