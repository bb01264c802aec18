"""The kernel dispatch point (kernels/dispatch.py): the mode is per thread, reference_kernels()
turns every kernel predicate off before it looks at its arguments, named_kernels() names the numba
calls in profiles, and both nest and restore."""

from __future__ import annotations

import threading

import pytest
import torch

from strata.kernels import attention, cpu_gemv, cpu_norm, cpu_quant, cpu_rope, dispatch
from strata.kernels.linear import quant_swiglu

needs_numba = pytest.mark.skipif(not cpu_gemv.available(), reason="numba not installed")


class _Untouchable:
    """Stands in for an fx Proxy: any use of it fails."""

    def __getattr__(self, name):
        raise AssertionError(f"predicate looked at its argument ({name})")


@needs_numba
def test_reference_kernels_answer_false_first():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    cache = torch.zeros(2, 2, 4, 1, 8)
    assert cpu_gemv.usable(x, w) and cpu_norm.usable(x, w[0]) and cpu_rope.usable(x, cache)
    u = _Untouchable()
    with dispatch.reference_kernels() as mode:
        assert mode == dispatch.KernelMode(fast_paths=False)
        assert not cpu_gemv.few_fp32_rows(u, u, 16)
        assert not cpu_gemv.usable(u, u) and not cpu_norm.usable(u, u) and not cpu_rope.usable(u, u)
        assert not cpu_quant.usable(u, u)
        assert quant_swiglu(u, u) is None
        assert not attention.fused_decode_usable(u, u, u)
    assert dispatch.current() == dispatch.DEFAULT and cpu_gemv.usable(x, w)


def test_mode_is_per_thread():
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait()
        seen["other"] = dispatch.current()
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with dispatch.reference_kernels(), dispatch.named_kernels():
        assert dispatch.current() == dispatch.KernelMode(fast_paths=False, named=True)
        inside.set()
        done.wait(10)
    t.join(10)
    assert seen["other"] == dispatch.DEFAULT
    assert dispatch.current() == dispatch.DEFAULT


@needs_numba
def test_named_kernels_record_ranges():
    x, w = torch.randn(2, 8), torch.randn(4, 8)

    def ranges(named: bool) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if named:
                with dispatch.named_kernels():
                    cpu_gemv.gemv(x, w)
            else:
                cpu_gemv.gemv(x, w)
        return {e.name for e in prof.events()}

    assert "numba::gemv" in ranges(True)
    assert "numba::gemv" not in ranges(False)
    torch.testing.assert_close(cpu_gemv.gemv(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_kernel_decorator():
    calls = []

    @dispatch.kernel("probe")
    def probe(a, b=1):
        calls.append((a, b))
        return a + b

    assert probe.kernel_name == "numba::probe" and probe.__name__ == "probe"
    assert probe(1, b=2) == 3 and probe.__wrapped_kernel__(4) == 5
    with dispatch.named_kernels():
        assert probe(2) == 3
    assert calls == [(1, 2), (4, 1), (2, 1)]
