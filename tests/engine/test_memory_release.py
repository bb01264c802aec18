"""Memory: reservations are not resident until used, and dropping an LLM frees everything.

RSS is read from the kernel (psutil) around real allocations; the bounds are generous against
the allocator's slack but far below the sizes involved (256 MiB of KV written, 1 GiB reserved).
"""

from __future__ import annotations

import gc

import psutil
import pytest
from conftest import make_llm

from strata import SamplingParams
from strata.config import parse_bytes
from strata.errors import CapacityError, ConfigError, RequestError

MiB = 2**20
SLACK = 64 * MiB


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.fixture
def no_gc():
    """Nothing may depend on the cycle collector: it stays off for the test."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _fill(llm) -> None:
    for cache in llm.engine.kv_caches:  # make every KV page resident
        cache.fill_(1.0)


def test_untouched_reservation_is_not_resident(tiny_model, no_gc):
    start = _rss()
    llm = make_llm(tiny_model, kv_cache_memory="1GiB", preemption_mode="swap", swap_space="512MiB")
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.engine.plan.kv_cache_bytes >= 1000 * MiB
    assert _rss() - start < 200 * MiB  # 1.5 GiB reserved (KV + swap), a few blocks used


@pytest.mark.parametrize("how", ["del", "close", "with"])
def test_dropping_an_llm_frees_it_without_the_gc(tiny_model, no_gc, how):
    start = _rss()
    if how == "with":
        with make_llm(tiny_model, kv_cache_memory="256MiB") as llm:
            _fill(llm)
            assert _rss() - start > 200 * MiB
        assert _rss() - start < SLACK
        with pytest.raises(RequestError, match="closed"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
        return
    llm = make_llm(tiny_model, kv_cache_memory="256MiB", fuse=True)  # FX tracing too: no cycles left
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, n=2), use_tqdm=False)
    _fill(llm)
    assert _rss() - start > 200 * MiB
    if how == "close":
        llm.close()
        assert _rss() - start < SLACK
        llm.close()  # idempotent
    else:
        del llm
        assert _rss() - start < SLACK


def test_kv_cache_larger_than_memory_is_a_clear_error(tiny_model):
    with pytest.raises(CapacityError, match=r"kv_cache_memory: .* asked, but only .* available"):
        make_llm(tiny_model, kv_cache_memory="1PB")
    with pytest.raises(CapacityError, match=r"swap_space: .* asked, but only .* available"):
        make_llm(tiny_model, preemption_mode="swap", swap_space="1PB")


@pytest.mark.parametrize("text, value", [
    ("1TB", 10**12), ("1tb", 10**12), ("2TiB", 2 * 2**40), ("2Ti", 2 * 2**40), ("1.5GB", 1_500_000_000),
    ("4GiB", 4 * 2**30), ("512mib", 512 * MiB), ("3k", 3000), ("3KiB", 3072), ("1PB", 10**15), ("64", 64),
])
def test_every_binary_and_decimal_unit_parses(text, value):
    assert parse_bytes(text, "x") == value


def test_unknown_unit_names_the_field():
    with pytest.raises(ConfigError, match="kv_cache_memory: cannot parse '4 bananas'"):
        parse_bytes("4 bananas", "kv_cache_memory")
