"""On a CUDA GPU: every compiled Triton kernel against its torch twin, and greedy generation with
the "triton" attention backend against "sdpa". Marked `gpu`; skipped without CUDA or triton.
scripts/gpu_check.sh runs them (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("triton.language")

from strata.graph.layers import RotaryEmbedding  # noqa: E402
from strata.kernels import triton as tk  # noqa: E402
from strata.kernels.attention import resolve_backend  # noqa: E402
from strata.protocol.sampling_params import SamplingParams  # noqa: E402
from tests.kernels.triton_kernels.triton_cases import paged_cache  # noqa: E402

DEV = "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got, expected, dtype):
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


def _paged(g, lens, block, kv_heads, dim, dtype):
    return tuple(t.to(DEV) for t in paged_cache(g, lens, block, kv_heads, dim, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, block, lens, partition",
    [
        (4, 4, 64, 16, [1], None),
        (9, 3, 64, 16, [37, 5, 16, 100], None),  # smol-135m
        (14, 2, 64, 16, [3, 70, 2047, 513], None),  # qwen-0.5b, long rows: several splits
        (14, 2, 64, 16, [3, 70, 2047, 513], 64),  # forced small partitions
        (7, 7, 80, 32, [33, 65, 1], None),  # head_dim not a power of two
        (32, 8, 128, 8, [1000, 17], None),
        (5, 1, 128, 128, [300], 128),
        (16, 2, 64, 64, list(range(1, 400, 7)), None),  # batch 57
    ],
)
def test_paged_decode_attention_cuda(heads, kv_heads, dim, block, lens, partition, dtype):
    g = torch.Generator().manual_seed(sum(lens) + heads + dim)
    cache, table, lens_t = _paged(g, lens, block, kv_heads, dim, dtype)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype).to(DEV)
    scale = dim**-0.5
    got = tk.paged_decode_attention_triton(q, cache, table, lens_t, scale, partition_size=partition)
    _close(got, tk.paged_decode_attention_ref(q, cache, table, lens_t, scale), dtype)
    if partition is None:  # the dispatcher picks the kernel on CUDA
        assert torch.equal(tk.paged_decode_attention(q, cache, table, lens_t, scale), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 896), (300, 4096), (3, 100)])
def test_add_rms_norm_cuda(rows, hidden, dtype):
    g = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(DEV)
    res = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    got, got_res = tk.add_rms_norm_triton(x, res, w, 1e-6)
    exp, exp_res = tk.add_rms_norm_ref(x, res, w, 1e-6)
    _close(got, exp, dtype)
    assert torch.equal(got_res, exp_res)  # GPUs round to nearest, like torch
    got_nr, none = tk.add_rms_norm_triton(x, None, w, 1e-6)
    assert none is None
    _close(got_nr, tk.add_rms_norm_ref(x, None, w, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (5, 4864), (257, 100)])
def test_silu_and_mul_cuda(rows, inter, dtype):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype).to(DEV)
    _close(tk.silu_and_mul_triton(gate_up), tk.silu_and_mul_ref(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [(1, 9, 3, 64), (37, 14, 2, 64), (5, 32, 8, 128)])
def test_rotary_cuda(tokens, heads, kv_heads, dim, dtype):
    g = torch.Generator().manual_seed(tokens + heads)
    rotary = RotaryEmbedding(dim, 4096, 10000.0, None)
    rotary.init_tables(DEV)
    rope = rotary(torch.randint(0, 4096, (tokens,), generator=g).to(DEV), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(DEV)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    gq, gk = tk.apply_rotary_qk_triton(q, k, rope)
    eq, ek = tk.apply_rotary_qk_ref(q, k, rope)
    _close(gq, eq, dtype)
    _close(gk, ek, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, kv_heads, dim, block", [(1, 3, 64, 16), (100, 2, 64, 8), (33, 8, 128, 32)])
def test_write_kv_cuda(tokens, kv_heads, dim, block, dtype):
    g = torch.Generator().manual_seed(tokens + dim)
    num_blocks = -(-tokens // block) + 2
    kv = torch.randn(tokens, 2 * kv_heads * dim, generator=g).to(dtype).to(DEV)
    k = kv[:, : kv_heads * dim].view(tokens, kv_heads, dim)
    v = kv[:, kv_heads * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(num_blocks * block, generator=g)[:tokens]
    slots[::5] = -1
    base = torch.randn(2, num_blocks, block, kv_heads, dim, generator=g).to(dtype).to(DEV)
    got, exp = base.clone(), base.clone()
    tk.write_kv_triton(got, k, v, slots.to(DEV))
    tk.write_kv_ref(exp, k, v, slots.to(DEV))
    assert torch.equal(got, exp)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_triton_matches_sdpa_on_cuda(tiny_models, llm_factory, prompt_of, dtype):
    """The engine end to end on CUDA: "auto" picks triton; greedy tokens equal the sdpa backend's
    (fp32: every token; bf16: the first few, where rounding cannot yet have flipped an argmax)."""
    prompts = [prompt_of(20, 40), prompt_of(21, 16), prompt_of(22, 33), prompt_of(23, 5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for family in ("llama", "llama3", "qwen3"):  # GQA 4:2, MQA + llama3 rope, q/k norm
        tokens = {}
        for backend in ("auto", "sdpa"):
            llm = llm_factory(tiny_models[family], device="cuda", dtype=dtype, attention_backend=backend,
                              kv_cache_memory="4MiB", block_size=16, max_num_batched_tokens=32)
            if backend == "auto":
                assert resolve_backend(llm.engine.runner.backend).name == "triton"  # a name or the backend
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[backend] = [o.outputs[0].token_ids for o in outs]
            del llm
        if dtype == "float32":
            assert tokens["auto"] == tokens["sdpa"], family
        else:
            assert [t[:3] for t in tokens["auto"]] == [t[:3] for t in tokens["sdpa"]], family
