"""The compiled LoRA add (kernels/cpu_lora.py) against its torch reference twin, LoRABank.add: rows
mixing no adapter and several slots, fused banks of 1 and 3 segments, adapters of lower rank than
the bank (zero-padded) and adapters that leave a segment out; the bits do not depend on threads. The
bank's own `add` takes this kernel for a few rows, so the reference runs under reference_kernels()."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.graph.lora import LoRABank, LoRABatch
from strata.kernels import cpu_lora
from strata.kernels.dispatch import reference_kernels

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="numba is not installed")

SEGMENTS = {1: [(0, 40)], 3: [(0, 32), (32, 40), (40, 48)]}  # o_proj-like; a fused qkv_proj (GQA)


def _bank(segments, n_in: int, rank: int, slots: int = 3, seed: int = 0, dtype=torch.float32) -> LoRABank:
    """Slots of different ranks (rank, rank - 1, rank - 3: padded); slot 2 leaves segment 1 out."""
    g = torch.Generator().manual_seed(seed)
    bank = LoRABank(n_in, segments, slots, rank, dtype=dtype)
    for s in range(slots):
        r = rank - (0, 1, 3)[s % 3]
        weights = {seg: (torch.randn(r, n_in, generator=g), torch.randn(hi - lo, r, generator=g), 0.5 + seg + s)
                   for seg, (lo, hi) in enumerate(segments) if not (s == 2 and seg == 1)}
        bank.set_slot(s, weights)
    return bank


def _views(bank: LoRABank) -> tuple:
    return (cpu_lora.bank_arrays(bank.lora_a), cpu_lora.bank_arrays(bank.lora_b), bank.scale.numpy(),
            cpu_lora.bounds_of(bank.segments))


def _compiled(bank, x, y, token_slots, threads: int) -> np.ndarray:
    out = y.numpy().copy()
    cpu_lora.lora_add(x.numpy(), *_views(bank), np.asarray(token_slots, np.int64), out, threads)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_seg", [1, 3])
@pytest.mark.parametrize("rank", [4, 8, 16, 7])
@pytest.mark.parametrize("token_slots", [[-1, 0, 1, 0, 2], [1], [2, 2, 2], [-1, -1, 0] + [1] * 13])
def test_lora_add_equals_the_bank(dtype, n_seg, rank, token_slots):
    """fp32 banks, and bf16 ones (their bits widened in the kernel, the torch form widening them too)."""
    n_in = 24
    bank = _bank(SEGMENTS[n_seg], n_in, rank, seed=rank, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    rows = len(token_slots)
    x, y = torch.randn(rows, n_in, generator=g), torch.randn(rows, SEGMENTS[n_seg][-1][1], generator=g)
    with torch.no_grad(), reference_kernels():  # the bank's torch form, not this kernel
        want = bank.add(x, y.clone(), LoRABatch.of(token_slots)).numpy()
    got = _compiled(bank, x, y, token_slots, threads=1)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(got - y.numpy()).max() > 1.0  # the adapters did add something
    none = [r for r, s in enumerate(token_slots) if s < 0]
    assert np.array_equal(got[none], y.numpy()[none])  # rows without an adapter: untouched, bit for bit
    for threads in (2, 3):  # each output one thread's sequential sum: the same bits
        assert np.array_equal(_compiled(bank, x, y, token_slots, threads), got)


def test_the_threaded_passes_equal_the_bank():
    """Past cpu_lora.PARALLEL_MACS the shrink and the expand split across threads: same bits as one."""
    segments = [(0, 384), (384, 512), (512, 640)]
    bank = _bank(segments, 512, 16)
    token_slots = [0, 1, -1, 2, 0, 1, 1, 0] * 2
    rows = len(token_slots)
    assert rows * (3 * 16 * 512 + 640 * 16) > cpu_lora.PARALLEL_MACS
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(rows, 512, generator=g), torch.randn(rows, 640, generator=g)
    with torch.no_grad(), reference_kernels():  # the bank's torch form, not this kernel
        want = bank.add(x, y.clone(), LoRABatch.of(token_slots)).numpy()
    got = _compiled(bank, x, y, token_slots, threads=2)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(_compiled(bank, x, y, token_slots, threads=1), got)
    assert np.array_equal(_compiled(bank, x, y, token_slots, threads=3), got)


def test_rows_sharing_a_slot_get_the_same_delta():
    bank = _bank(SEGMENTS[3], 24, 8)
    x = torch.randn(1, 24).repeat(4, 1)
    got = _compiled(bank, x, torch.zeros(4, 48), [0, 1, 0, 0], threads=2)
    assert np.array_equal(got[0], got[2]) and np.array_equal(got[0], got[3])
    assert not np.allclose(got[0], got[1])


def test_no_adapter_or_no_bank_adds_nothing():
    bank = _bank(SEGMENTS[1], 24, 8)
    x, y = torch.randn(3, 24), torch.randn(3, 40)
    assert np.array_equal(_compiled(bank, x, y, [-1, -1, -1], threads=2), y.numpy())
    out = y.numpy().copy()  # a projection without a bank (what the fused layer passes for one)
    cpu_lora.lora_add(x.numpy(), cpu_lora.NO_BANK, cpu_lora.NO_BANK, cpu_lora.NO_SCALE, np.zeros(1, np.int64),
                      np.zeros(3, np.int64), out, 2)
    assert np.array_equal(out, y.numpy())


def test_bad_arguments_are_refused_by_name():
    bank = _bank(SEGMENTS[3], 24, 8)
    x, y = np.zeros((2, 24), np.float32), np.zeros((2, 48), np.float32)
    with pytest.raises(ValueError, match="outside -1"):
        cpu_lora.lora_add(x, *_views(bank), np.array([0, 3]), y)  # the bank holds slots 0..2
    with pytest.raises(ValueError, match="do not fit one LoRA bank"):
        cpu_lora.lora_add(x, *_views(bank), np.array([0]), y)  # one slot for two rows
    with pytest.raises(ValueError, match="do not fit one LoRA bank"):
        cpu_lora.lora_add(np.zeros((2, 20), np.float32), *_views(bank), np.array([0, 1]), y)


@pytest.mark.parametrize("shape", [(5, 37), (16, 1500)])  # one thread; split across threads
def test_silu_mul_equals_torch(shape):
    rows, inter = shape
    gate_up = torch.randn(rows, 2 * inter) * 4
    want = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).numpy()
    outs = []
    for threads in (1, 2):
        out = np.empty((rows, inter), np.float32)
        cpu_lora.silu_mul(gate_up.numpy(), out, threads)
        assert np.allclose(out, want, rtol=1e-6, atol=1e-6)
        outs.append(out)
    assert np.array_equal(*outs)
    with pytest.raises(ValueError, match="not \\[rows, 2 x 36\\]"):
        cpu_lora.silu_mul(torch.zeros(5, 74).numpy(), np.empty((5, 36), np.float32))


@pytest.mark.parametrize("rows", [5, cpu_lora.EAGER_ROWS, cpu_lora.EAGER_ROWS + 1])
def test_the_banks_add_takes_the_kernel_for_a_few_rows(rows):
    """LoRABank.add (the eager decoder's path) runs this kernel up to EAGER_ROWS rows (its bits), the
    grouped torch form above; both equal the reference."""
    bank = _bank(SEGMENTS[3], 24, 8)
    token_slots = [(-1, 0, 1, 2)[r % 4] for r in range(rows)]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(rows, 24, generator=g), torch.randn(rows, 48, generator=g)
    with torch.no_grad():
        got = bank.add(x, y.clone(), LoRABatch.of(token_slots)).numpy()
        with reference_kernels():
            want = bank.add(x, y.clone(), LoRABatch.of(token_slots)).numpy()
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(got, _compiled(bank, x, y, token_slots, 2)) == (rows <= cpu_lora.EAGER_ROWS)
