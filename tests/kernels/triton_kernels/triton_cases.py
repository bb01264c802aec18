"""Every Triton kernel against its torch twin, case by case, for the interpreter.

Triton's interpreter is chosen when triton is imported (TRITON_INTERPRET=1 must be set first; its
standard library is decorated at import), so these cases run in a child process:
test_triton_interpreted.py starts `python triton_cases.py --out FILE` with the variable set, once
per session, and turns each case's result into one test. Run by hand:

    TRITON_INTERPRET=1 python tests/kernels/triton_kernels/triton_cases.py [-k SUBSTRING]

The parent imports this module only for the case ids; nothing here imports triton at import time.
Shapes are small: the interpreter runs each program instance in numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib

import torch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}
DT_NAME = {F32: "f32", F16: "f16", BF16: "bf16"}


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    return float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0


def paged_cache(g, lens, block, kv_heads, dim, dtype, spare: int = 3):
    """A cache with scattered (permuted) blocks, block tables padded with block 0, lens tensor."""
    num_blocks = sum(-(-n // block) for n in lens) + spare
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for n in lens:
        need = -(-n // block)
        tables.append(perm[start : start + need])
        start += need
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return cache, table_t, torch.tensor(lens)


# --- cases ----------------------------------------------------------------------------------


def case_attention(heads, kv_heads, dim, block, lens, dtype, partition=None, strided_q=False):
    from strata.kernels.triton import paged_decode_attention_ref, paged_decode_attention_triton

    g = _gen("attn", heads, kv_heads, dim, block, lens, dtype, partition)
    cache, tables, lens_t = paged_cache(g, lens, block, kv_heads, dim, dtype)
    b = len(lens)
    if strided_q:  # q as a view of a fused qkv projection row: row stride > heads * dim
        qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q = qkv[:, : heads * dim].view(b, heads, dim)
    else:
        q = torch.randn(b, heads, dim, generator=g).to(dtype)
    scale = dim**-0.5
    got = paged_decode_attention_triton(q, cache, tables, lens_t, scale, partition_size=partition)
    expected = paged_decode_attention_ref(q, cache, tables, lens_t, scale)
    assert got.shape == (b, heads * dim) and got.dtype == dtype
    return _close(got, expected, dtype)


def case_norm(rows, hidden, residual, dtype):
    from strata.kernels.triton import add_rms_norm_ref, add_rms_norm_triton

    g = _gen("norm", rows, hidden, residual, dtype)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype) if residual else None
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    got, got_res = add_rms_norm_triton(x, res, w, 1e-6)
    exp, exp_res = add_rms_norm_ref(x, res, w, 1e-6)
    err = _close(got, exp, dtype, "out")
    if residual and dtype == BF16:  # the interpreter truncates fp32 -> bf16 (GPUs round to nearest)
        _close(got_res, exp_res, dtype, "residual")
    elif residual:
        assert torch.equal(got_res, exp_res), "new residual differs"
    else:
        assert got_res is None
    return err


def case_silu(rows, inter, dtype, lead=None):
    from strata.kernels.triton import silu_and_mul_ref, silu_and_mul_triton

    g = _gen("silu", rows, inter, dtype, lead)
    shape = (*(lead or ()), rows, 2 * inter)
    gate_up = (torch.randn(shape, generator=g) * 4).to(dtype)
    got = silu_and_mul_triton(gate_up)
    exp = silu_and_mul_ref(gate_up)
    assert got.shape == exp.shape
    return _close(got, exp, dtype)


# a completed yarn scaling dict, as ModelConfig leaves it (factor 4: attention factor 0.1 ln 4 + 1)
YARN_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": True, "attention_factor": 1.1386294361119891}


def case_rotary(tokens, heads, kv_heads, dim, dtype, from_qkv=True, scaling=None):
    from strata.graph.layers import RotaryEmbedding
    from strata.kernels.triton import apply_rotary_qk_ref, apply_rotary_qk_triton

    g = _gen("rope", tokens, heads, kv_heads, dim, dtype, from_qkv, scaling)
    rotary = RotaryEmbedding(dim, 512, 10000.0, scaling)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    rope = rotary(positions, dtype)
    if from_qkv:  # as the engine slices its fused projection: strided rows
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q = qkv[:, : heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    else:
        q = torch.randn(tokens, heads, dim, generator=g).to(dtype)
        k = torch.randn(tokens, kv_heads, dim, generator=g).to(dtype)
    gq, gk = apply_rotary_qk_triton(q, k, rope)
    eq, ek = apply_rotary_qk_ref(q, k, rope)
    return max(_close(gq, eq, dtype, "q"), _close(gk, ek, dtype, "k"))


def case_write_kv(tokens, kv_heads, dim, block, dtype, from_qkv=True, padding=False):
    from strata.kernels.triton import write_kv_ref, write_kv_triton

    g = _gen("kv", tokens, kv_heads, dim, block, dtype, from_qkv, padding)
    num_blocks = -(-tokens // block) + 2
    heads = 2 * kv_heads
    if from_qkv:
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    else:
        k = torch.randn(tokens, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(tokens, kv_heads, dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block, generator=g)[:tokens]
    if padding:
        slots[::3] = -1
    base = torch.randn(2, num_blocks, block, kv_heads, dim, generator=g).to(dtype)
    got, exp = base.clone(), base.clone()
    write_kv_triton(got, k, v, slots)
    write_kv_ref(exp, k, v, slots)
    assert torch.equal(got, exp), "cache contents differ"
    return 0.0


_SHORT = {"heads": "h", "kv_heads": "kv", "dim": "d", "block": "bs", "lens": "len", "partition": "part",
          "rows": "rows", "hidden": "n", "inter": "i", "tokens": "t", "lead": "lead"}


def _id(kind: str, kw: dict) -> str:
    parts = [kind]
    for key, val in kw.items():
        if key == "dtype":
            parts.append(DT_NAME[val])
        elif val is True:
            parts.append(key)
        elif val not in (None, False):
            parts.append(f"{_SHORT.get(key, key)}{val}".replace(" ", ""))
    return "-".join(parts)


def build_cases() -> dict[str, tuple]:
    cases: dict[str, tuple] = {}

    def add(fn, kind, **kw):
        cases[_id(kind, kw)] = (fn, kw)

    attn = [
        # heads, kv_heads, dim, block, lens, dtype, partition
        (4, 4, 16, 8, [1], F32, None),  # GQA ratio 1, batch 1, a lone token
        (6, 3, 32, 16, [37, 5, 16, 100], F32, None),  # ratio 2, partial and full last blocks
        (14, 2, 64, 16, [3, 70], F32, None),  # ratio 7 (qwen-0.5b), head_dim 64
        (7, 7, 24, 32, [33, 65, 1], F32, None),  # odd heads, head_dim not a power of two
        (9, 3, 16, 8, [50, 9], F32, 16),  # ratio 3 (smol-135m), split-K: 4 splits + merge
        (14, 2, 32, 16, [130, 7, 64], F32, 32),  # ratio 7, splits, empty splits for short rows
        (5, 1, 16, 64, [70], F32, None),  # MQA, odd query heads, block 64
        (4, 2, 32, 128, [129, 3], F32, 64),  # block 128, partitions inside one block
        (3, 3, 16, 8, [11, 1, 29, 8, 16, 3, 40, 17], F32, None),  # batch 8
        (6, 2, 32, 16, [40, 17], F16, 16),
        (6, 2, 32, 8, [40, 17], BF16, None),
        (14, 2, 64, 32, [45, 2], BF16, 32),
    ]
    for h, kvh, d, blk, lens, dt, part in attn:
        add(case_attention, "attention", heads=h, kv_heads=kvh, dim=d, block=blk,
            lens=",".join(map(str, lens)), dtype=dt, partition=part)
    add(case_attention, "attention", heads=6, kv_heads=2, dim=16, block=16, lens="19,4", dtype=F32,
        partition=None, strided_q=True)

    for rows, hidden, res, dt in [
        (1, 64, True, F32), (5, 100, True, F32), (3, 576, False, F32), (33, 8, True, F32),
        (4, 64, True, F16), (4, 100, True, BF16), (2, 576, False, BF16),
    ]:
        add(case_norm, "norm", rows=rows, hidden=hidden, residual=res, dtype=dt)

    for rows, inter, dt in [(1, 16, F32), (7, 100, F32), (3, 1536, F32), (5, 96, F16), (4, 200, BF16)]:
        add(case_silu, "silu", rows=rows, inter=inter, dtype=dt)
    add(case_silu, "silu", rows=3, inter=24, dtype=F32, lead=(2,))

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    for t, h, kvh, d, dt, from_qkv in [
        (1, 9, 3, 64, F32, True), (5, 4, 1, 32, F32, True), (3, 14, 2, 64, F32, False),
        (2, 3, 3, 8, F32, True), (4, 5, 1, 24, F32, True), (3, 6, 2, 32, F16, True),
        (3, 6, 2, 32, BF16, True),
    ]:
        add(case_rotary, "rotary", tokens=t, heads=h, kv_heads=kvh, dim=d, dtype=dt, from_qkv=from_qkv)
    cases["rotary-llama3-scaling"] = (case_rotary, dict(
        tokens=3, heads=4, kv_heads=2, dim=16, dtype=F32, from_qkv=True, scaling=llama3))
    # yarn's attention factor scales the cos/sin tables the kernel reads (a gain != 1)
    cases["rotary-yarn-scaling"] = (case_rotary, dict(
        tokens=3, heads=4, kv_heads=2, dim=16, dtype=F32, from_qkv=True, scaling=YARN_SCALING))

    for t, kvh, d, blk, dt, from_qkv, pad in [
        (1, 3, 64, 16, F32, True, False), (7, 2, 16, 8, F32, True, False),
        (12, 1, 24, 32, F32, False, False), (9, 3, 16, 8, F32, True, True),
        (5, 2, 32, 16, F16, True, False), (5, 2, 32, 16, BF16, False, False),
    ]:
        add(case_write_kv, "write_kv", tokens=t, kv_heads=kvh, dim=d, block=blk, dtype=dt,
            from_qkv=from_qkv, padding=pad)
    return cases


CASES = build_cases()


def _decode_kwargs(kw: dict) -> dict:
    kw = dict(kw)
    if isinstance(kw.get("lens"), str):
        kw["lens"] = [int(n) for n in kw["lens"].split(",")]
    return kw


def run(ids: list[str]) -> dict[str, dict]:
    from strata.kernels.triton import paged_attention

    assert paged_attention.triton is not None, "triton is not importable"
    assert type(paged_attention._decode_kernel).__name__ == "InterpretedFunction", (
        "not interpreting: set TRITON_INTERPRET=1 before triton is imported"
    )
    results = {}
    for cid in ids:
        fn, kw = CASES[cid]
        t0 = time.perf_counter()
        try:
            err = fn(**_decode_kwargs(kw))
            results[cid] = {"ok": True, "max_abs_err": err, "secs": time.perf_counter() - t0}
        except Exception:  # noqa: BLE001 - every failure is reported to the parent
            results[cid] = {"ok": False, "error": traceback.format_exc(), "secs": time.perf_counter() - t0}
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write results as JSON here (default: print a summary)")
    ap.add_argument("-k", default="", help="only case ids containing this substring")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (the kernels run on CPU tensors under the interpreter)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    results = run([c for c in CASES if args.k in c])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    else:
        for cid, r in results.items():
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['secs']:6.2f}s {cid}")
            if not r["ok"]:
                print(r["error"])
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
