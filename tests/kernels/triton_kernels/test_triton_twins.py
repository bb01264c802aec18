"""The Triton kernels' torch twins against Strata's existing reference paths, and the dispatch.

None of this needs triton: the twins are the CPU path, so they run (and are checked) everywhere.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from strata.graph.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from strata.kernels import attention
from strata.kernels.attention import (
    AttentionMetadata,
    PrefillSpan,
    decode_attention,
    paged_attention,
    resolve_backend,
)
from strata.kernels.triton import (
    add_rms_norm,
    add_rms_norm_ref,
    apply_rotary_qk,
    apply_rotary_qk_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    silu_and_mul,
    silu_and_mul_ref,
    write_kv,
    write_kv_ref,
)
from tests.kernels.triton_kernels.triton_cases import YARN_SCALING, paged_cache


@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, lens, dtype",
    [
        (4, 4, 16, 8, [1], torch.float32),
        (6, 3, 32, 16, [37, 5, 16, 100], torch.float32),
        (14, 2, 64, 32, [3, 70], torch.float32),
        (7, 1, 24, 16, [33, 65, 1], torch.float32),
        (6, 2, 32, 8, [40, 17], torch.bfloat16),
    ],
)
def test_paged_attention_twin_matches_torch_backend(heads, kv_heads, dim, block, lens, dtype):
    g = torch.Generator().manual_seed(sum(lens) + heads)
    cache, tables, lens_t = paged_cache(g, lens, block, kv_heads, dim, dtype)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    keys = torch.arange(tables.shape[1] * block)
    mask = (keys[None, :] < lens_t[:, None]).view(len(lens), 1, 1, -1)
    meta = AttentionMetadata(torch.empty(0), [], 0, tables, mask, lens_t, backend="torch")
    scale = dim**-0.5
    expected = decode_attention(q, cache, meta, scale)
    got = paged_decode_attention_ref(q, cache, tables, lens_t, scale)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_triton_backend_on_cpu_is_the_twin_and_matches_torch():
    """attention.py's "triton" backend: a mixed prefill + decode step equals the "torch" backend."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block = 6, 2, 16, 8
    cache0, tables, lens_t = paged_cache(g, [13, 30], block, kv_heads, dim, torch.float32)
    n_pref = 5  # a fresh 5-token prompt in its own blocks, then the two decodes
    pref_table = torch.tensor([cache0.shape[1] - 1])
    slots = torch.cat([pref_table[0] * block + torch.arange(n_pref),
                       torch.stack([tables[i, (n - 1) // block] * block + (n - 1) % block
                                    for i, n in enumerate(lens_t.tolist())])])
    tokens = n_pref + 2
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    v = torch.randn(tokens, kv_heads, dim, generator=g)
    keys = torch.arange(tables.shape[1] * block)
    mask = (keys[None, :] < lens_t[:, None]).view(2, 1, 1, -1)
    outs = {}
    for backend in ("torch", "triton"):
        cache = cache0.clone()
        meta = AttentionMetadata(slots, [PrefillSpan(0, n_pref, 0, pref_table, None)], n_pref, tables, mask,
                                 lens_t, backend=backend)
        outs[backend] = paged_attention(q, k, v, cache, meta, dim**-0.5)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
    assert "triton" in attention.BACKENDS and not attention.triton_usable("cpu")


@pytest.mark.parametrize("rows, dtype", [(3, torch.float32), (40, torch.float32), (5, torch.bfloat16)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_twin_matches_rmsnorm(rows, dtype, with_residual):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=g))
    x = torch.randn(rows, 96, generator=g).to(dtype)
    res = torch.randn(rows, 96, generator=g).to(dtype) if with_residual else None
    with torch.inference_mode():
        expected = norm(x, res)
        got, new_res = add_rms_norm_ref(x, res, norm.weight, norm.eps)
    if with_residual:
        torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(new_res, expected[1])
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert new_res is None


@pytest.mark.parametrize("rows, dtype", [(2, torch.float32), (20, torch.float32), (3, torch.bfloat16)])
def test_silu_twin_matches_gated_mlp(rows, dtype):
    """Checks the layout too: GatedMLP's fused projection is [gate; up] along the last dim. In bf16
    the MLP's few-row CPU path fuses SwiGLU into the GEMV in fp32 (kernels/cpu_bf16.py) where the
    twin rounds gate/up to bf16 first: they agree to bf16 rounding (a layout error would not)."""
    torch.manual_seed(rows)
    mlp = GatedMLP(32, 48, bias=False).to(dtype)
    x = torch.randn(rows, 32).to(dtype)
    with torch.inference_mode():
        expected = mlp(x)
        got = mlp.down_proj(silu_and_mul_ref(mlp.gate_up_proj(x)))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}, YARN_SCALING])
def test_rotary_twin_matches_apply_rotary(dtype, scaling):
    """As the model applies it: q and k adjacent in the fused qkv output, rotated in one call."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, kv_heads, dim = 5, 6, 2, 32
    rope = RotaryEmbedding(dim, 256, 10000.0, scaling)(torch.randint(0, 256, (tokens,), generator=g), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), rope)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    got_q, got_k = apply_rotary_qk_ref(q, k, rope)
    assert torch.equal(got_q, qk[:, :heads]) and torch.equal(got_k, qk[:, heads:])


def test_write_kv_twin_matches_attention_write_kv():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 8, 3, 16, generator=g)
    k, v = torch.randn(2, 10, 3, 16, generator=g)
    slots = torch.randperm(48, generator=g)[:10]
    expected, got = cache.clone(), cache.clone()
    attention.write_kv(expected, k, v, slots)
    write_kv_ref(got, k, v, slots)
    assert torch.equal(got, expected)
    padded = torch.where(torch.arange(10) % 4 == 0, -1, slots)  # negative slots are skipped
    got2 = cache.clone()
    write_kv_ref(got2, k, v, padded)
    keep = padded >= 0
    expected2 = cache.clone()
    attention.write_kv(expected2, k[keep], v[keep], slots[keep])
    assert torch.equal(got2, expected2)


def test_dispatch_on_cpu_runs_the_twins():
    g = torch.Generator().manual_seed(2)
    cache, tables, lens = paged_cache(g, [9, 3], 4, 2, 8, torch.float32)
    q = torch.randn(2, 4, 8, generator=g)
    assert torch.equal(paged_decode_attention(q, cache, tables, lens, 0.3),
                       paged_decode_attention_ref(q, cache, tables, lens, 0.3))
    x, r, w = torch.randn(3, 8, 8, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(add_rms_norm(x, r, w[0], 1e-6), add_rms_norm_ref(x, r, w[0], 1e-6)))
    gu = torch.randn(3, 16, generator=g)
    assert torch.equal(silu_and_mul(gu), silu_and_mul_ref(gu))
    rope = RotaryEmbedding(8, 16, 10000.0, None)(torch.arange(3), torch.float32)
    qq, kk = torch.randn(3, 4, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(apply_rotary_qk(qq, kk, rope), apply_rotary_qk_ref(qq, kk, rope)))
    c1, c2 = cache.clone(), cache.clone()
    write_kv(c1, kk, kk, torch.tensor([0, 5, 9]))
    write_kv_ref(c2, kk, kk, torch.tensor([0, 5, 9]))
    assert torch.equal(c1, c2)


_NO_TRITON = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import torch
import strata.kernels.attention
assert "triton" not in sys.modules
import strata.kernels.triton as t
assert not t.available() and not strata.kernels.attention.triton_usable("cuda")
q, cache = torch.randn(1, 2, 8), torch.randn(2, 2, 4, 1, 8)
out = t.paged_decode_attention(q, cache, torch.tensor([[0, 1]]), torch.tensor([6]), 0.5)
assert out.shape == (1, 16)
try:
    t.silu_and_mul_triton(torch.randn(2, 8))
except RuntimeError as e:
    assert "not installed" in str(e)
else:
    raise AssertionError("launching without triton should fail clearly")
print("ok")
"""


def test_everything_imports_and_runs_without_triton():
    """Block triton's import in a fresh interpreter: the package imports, dispatch uses the twins,
    and kernels.attention (every CPU run) never imports triton."""
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_engine_backend_choice_on_cpu(tiny_models, llm_factory):
    """Nothing changes on CPU: auto never picks triton there, and asking for it is a clear error."""
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="attention_backend: 'triton' needs a CUDA device"):
        llm_factory(tiny_models["llama"], attention_backend="triton")
    assert resolve_backend(llm_factory(tiny_models["llama"]).engine.runner.backend).name == "cpu"
