"""Attention backends (kernels/attention/): the registry, select_backend's rules and messages, and
every backend computing one mixed prefill + decode step as the "torch" reference does."""

from __future__ import annotations

import pytest
import torch

from strata.errors import ConfigError
from strata.kernels import attention, cpu_attention
from strata.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    get_backend,
    paged_attention,
    select_backend,
)
from tests.kernels.triton_kernels.triton_cases import paged_cache


def test_registry_and_interface():
    assert attention.BACKENDS == ("torch", "sdpa", "cpu", "triton")
    for name in attention.BACKENDS:
        b = get_backend(name)
        assert isinstance(b, AttentionBackend) and b.name == name
        assert attention.resolve_backend(b) is b and attention.resolve_backend(name) is b
    assert {n: get_backend(n).uses_decode_mask for n in attention.BACKENDS} == {
        "torch": True, "sdpa": True, "cpu": False, "triton": False,
    }
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash")
    meta = AttentionMetadata(torch.empty(0), [], 0, None, None)
    assert meta.backend is get_backend("sdpa")  # the default
    assert AttentionMetadata(torch.empty(0), [], 0, None, None, backend="cpu").backend is get_backend("cpu")


def test_select_backend_rules():
    numba = cpu_attention.available()
    assert select_backend("auto", "cpu", torch.float32).name == ("cpu" if numba else "sdpa")
    assert select_backend("auto", "cpu", torch.bfloat16).name == "sdpa"
    assert select_backend("auto", "cuda", torch.float32).name == ("triton" if attention.triton_usable("cuda") else "sdpa")
    for name in ("torch", "sdpa"):
        assert select_backend(name, "cpu", torch.bfloat16).name == name
    if numba:
        assert select_backend("cpu", "cpu", torch.float32).name == "cpu"
    with pytest.raises(ConfigError) as e:
        select_backend("cpu", "cpu", torch.bfloat16)
    assert str(e.value) == "attention_backend: 'cpu' needs numba, device cpu and dtype float32; use 'auto' or 'sdpa'"
    with pytest.raises(ConfigError) as e:
        select_backend("triton", "cpu", torch.float32)
    assert str(e.value) == (
        "attention_backend: 'triton' needs a CUDA device and triton (pip install 'strata[triton]'); "
        "use 'auto' or 'sdpa'"
    )
    with pytest.raises(ConfigError, match="attention_backend: unknown 'flash'; choose auto, torch, sdpa, cpu or triton"):
        select_backend("flash", "cpu", torch.float32)


@pytest.mark.parametrize("name", ["sdpa", "cpu", "triton"])
def test_backend_matches_torch_on_a_mixed_step(name):
    if name == "cpu" and not cpu_attention.available():
        pytest.skip("numba not installed")
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, block = 6, 2, 16, 8
    cache0, tables, lens_t = paged_cache(g, [13, 30], block, kv_heads, dim, torch.float32)
    n_pref, ctx = 5, 3  # a 5-token chunk after 3 cached tokens, in the spare blocks, then two decodes
    pref_table = torch.tensor([cache0.shape[1] - 2, cache0.shape[1] - 1])
    pos = torch.arange(ctx, ctx + n_pref)
    slots = torch.cat([pref_table[pos // block] * block + pos % block,
                       torch.stack([tables[i, (n - 1) // block] * block + (n - 1) % block
                                    for i, n in enumerate(lens_t.tolist())])])
    tokens = n_pref + 2
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    span_mask = torch.arange(ctx + n_pref)[None, :] <= pos[:, None]
    span = PrefillSpan(0, n_pref, ctx, pref_table, span_mask)
    keys = torch.arange(tables.shape[1] * block)
    mask = (keys[None, :] < lens_t[:, None]).view(2, 1, 1, -1)
    outs = {}
    for backend in ("torch", name):
        b = get_backend(backend)
        cache = cache0.clone()
        meta = AttentionMetadata(slots, [span], n_pref, tables, mask if b.uses_decode_mask else None, lens_t,
                                 backend=b)
        outs[backend] = paged_attention(q, k, v, cache, meta, dim**-0.5)
    torch.testing.assert_close(outs[name], outs["torch"], rtol=1e-5, atol=1e-5)
