"""LoRA deltas on a few fp32 rows, the rows grouped by adapter slot (Punica SGMV / S-LoRA style).

The fused CPU decode layer (kernels/cpu_decode_layer.lora_layer) adds each row's adapter to a
projection's output in one compiled call over that projection's bank, numpy views of
graph/lora.LoRABank's tensors:

    a [slots, segments * rank, in]    b [slots, out, rank]    scale [slots, segments]

(A and B fp32, or bf16 passed as their int16 bit patterns and widened exactly in registers: half
the bytes, the same arithmetic.)

shrink, xa[r] = A[s] @ x[r] (every segment's rank block at once), then expand, per segment g,
out[r, lo_g:hi_g] += scale[s, g] * (B[s, lo_g:hi_g] @ xa[r, g*rank:(g+1)*rank]), where s is row
r's slot (-1: no adapter, the row untouched). The rows are grouped by slot first, and both passes
run slot-major: each A row and each B row is read once, for all the rows of its slot in turn, so
an adapter streams from memory once a step however many rows share it. Above PARALLEL_MACS the
passes split across threads ((slot, A row) items, then (slot, output column) items); each output
is one thread's sequential sum either way, so the bits do not depend on the thread count. A
segment an adapter leaves out (scale 0: its A and B blocks are zeros) is skipped.

The eager decoder (graph/lora.LoRABank.add) takes the same kernel for steps of up to EAGER_ROWS
rows (a decode step too wide for the fused layer), the rows grouped into torch GEMMs above.

Reference twin: LoRABank.add, (x @ A^T) @ B^T * scale added to the output; tests compare the two.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels.dispatch import fast_paths, kernel

try:
    import numba
    from numba import njit, prange

    from strata.kernels import cpu_gemv
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

# Below this many multiply-adds a delta runs on the calling thread: starting the pool's threads
# twice (shrink, expand; ~4.5 us each on 2 threads) costs more than it saves there. Measured on the
# dev box (2 cores, smol-135m shapes, rank 16, batch 1, adapters out of cache): ~36 us a layer on
# one thread, ~53 us split in two.
PARALLEL_MACS = 1 << 17

NO_BANK = np.empty((0, 0, 0), np.float32)  # the A and B of a projection without adapters
NO_SCALE = np.empty((0, 0), np.float32)


# The eager decoder (graph/lora.LoRABank.add) takes this kernel for steps of at most this many rows:
# a decode step's rows spread over many adapters, where the torch form's two small matmuls per
# adapter per projection cost more in dispatch than in arithmetic. Above it (prefill chunks), rows
# are grouped by adapter into GEMMs, which reuse each x row from cache where the kernel re-reads it
# once per A row.
EAGER_ROWS = 64


def available() -> bool:
    return numba is not None


def usable(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether `add_rows` can add a bank's deltas to y [rows, out] for x [rows, in] here: fp32 CPU
    activations outside autograd, an fp32 or bf16 bank, at most EAGER_ROWS rows, y contiguous
    (written in place)."""
    return (numba is not None and fast_paths() and not torch.is_grad_enabled() and x.shape[0] <= EAGER_ROWS
            and x.dtype == y.dtype == torch.float32 and a.dtype in (torch.float32, torch.bfloat16)
            and x.is_cpu and y.is_cpu and a.is_cpu and y.is_contiguous())


def bank_arrays(t: torch.Tensor) -> np.ndarray:
    """A bank tensor as the kernel reads it: fp32 as is, bf16 as its int16 bit patterns."""
    t = t.detach()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@kernel("lora_add")
def add_rows(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
             bounds: np.ndarray, token_slots: np.ndarray) -> None:
    """y[r] += row r's adapter delta in place (torch tensors; `usable` said yes; a bank's own tensors,
    so only the token slots are checked, inside the kernel)."""
    xs = x.detach().contiguous().numpy()
    an = bank_arrays(a)
    _lora_add(xs, an, bank_arrays(b), scale.numpy(), bounds, token_slots,
              np.empty((xs.shape[0], an.shape[1]), np.float32), y.numpy(), cpu_gemv.sync_threads())


def bounds_of(segments) -> np.ndarray:
    """A bank's segments ((lo, hi) output ranges, in order) as [segments + 1] int64 column bounds."""
    return np.array([segments[0][0], *(hi for _, hi in segments)], np.int64)


def check(x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.ndarray, bounds: np.ndarray,
          token_slots: np.ndarray, out: np.ndarray) -> None:
    """Raise ValueError unless the arguments fit one bank's layout and its slots."""
    rows = x.shape[0]
    slots, k, n_in = a.shape
    nseg = scale.shape[1] if scale.ndim == 2 else -1
    fits = (out.ndim == 2 and out.shape[0] == rows and token_slots.shape == (rows,) and x.ndim == 2
            and token_slots.dtype == np.int64 and all(t.dtype == np.float32 for t in (x, scale, out))
            and a.dtype == b.dtype and a.dtype in (np.float32, np.int16))
    if slots:
        fits = fits and (n_in == x.shape[1] and b.ndim == 3 and b.shape[:2] == (slots, out.shape[1])
                         and scale.shape == (slots, nseg) and k == b.shape[2] * nseg and bounds.ndim == 1
                         and len(bounds) >= nseg + 1 and bounds[0] == 0 and bounds[nseg] == out.shape[1]
                         and bool((np.diff(bounds[: nseg + 1]) >= 0).all()))
    if not fits:
        raise ValueError(f"lora_add: x {x.shape} {x.dtype}, A {a.shape}, B {b.shape}, scale {scale.shape}, "
                         f"bounds {list(bounds)}, out {out.shape}, token_slots {token_slots.shape} "
                         f"{token_slots.dtype} do not fit one LoRA bank's layout (fp32 or bf16 bits A [slots, segments * rank, in], "
                         "B [slots, out, rank], scale [slots, segments]; int64 token slots, one per row)")
    if slots and rows and (token_slots.min() < -1 or token_slots.max() >= slots):
        raise ValueError(f"lora_add: token slots {token_slots.tolist()} outside -1 (no adapter) .. {slots - 1} "
                         f"(the bank holds {slots} adapters)")


@kernel("lora_add")
def lora_add(x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.ndarray, bounds: np.ndarray,
             token_slots: np.ndarray, out: np.ndarray, threads: int = 1) -> None:
    """out[r] += row r's adapter delta, in place (numpy rows; see the module docstring; numba only).
    The fused layer calls `_lora_add` itself, its arguments checked once when the step is built."""
    check(x, a, b, scale, bounds, token_slots, out)
    _lora_add(x, a, b, scale, bounds, token_slots, np.empty((x.shape[0], a.shape[1]), np.float32), out, threads)


@kernel("silu_mul")
def silu_mul(gate_up: np.ndarray, out: np.ndarray, threads: int = 1) -> None:
    """out = silu(gate) * up for gate_up [rows, 2 * inter] = [gate | up] (the LoRA layer's SwiGLU
    after the adapters were added to gate and up)."""
    if gate_up.shape != (out.shape[0], 2 * out.shape[1]):
        raise ValueError(f"silu_mul: gate_up {gate_up.shape} is not [rows, 2 x {out.shape[1]}]")
    _silu_mul(gate_up, out, threads)


def _dot(w, v, n):  # pragma: no cover - the compiled forms below
    """sum_c w[c] * v[c] over n columns: w fp32, or bf16 bit patterns (int16) widened exactly."""
    raise NotImplementedError


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload

    @intrinsic
    def _f32_of_bits(typingctx, bits):  # pragma: no cover - compiled
        """The float32 whose bit pattern is the uint32 `bits`."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @overload(_dot, jit_options={"fastmath": True})
    def _dot_of(w, v, n):  # pragma: no cover - compiled
        if w.dtype == types.int16:  # bf16: the top half of an fp32
            def bf16_dot(w, v, n):
                acc = np.float32(0.0)
                for c in range(n):
                    acc += _f32_of_bits(np.uint32(np.uint16(w[c])) << np.uint32(16)) * v[c]
                return acc
            return bf16_dot

        def f32_dot(w, v, n):
            acc = np.float32(0.0)
            for c in range(n):
                acc += w[c] * v[c]
            return acc
        return f32_dot

    @njit(cache=True, inline="always")
    def _by_slot(token_slots, n_slots):  # pragma: no cover - compiled
        """The rows grouped by slot: order[starts[s]:starts[s + 1]] are slot s's rows, `present` the
        slots some row uses (in slot order)."""
        starts = np.zeros(n_slots + 1, np.int64)
        for r in range(token_slots.shape[0]):
            s = token_slots[r]
            if s >= n_slots or s < -1:  # checked here, where it costs nothing: add_rows trusts its caller
                raise ValueError("lora_add: a token slot outside -1 (no adapter) .. the bank's slots")
            if s >= 0:
                starts[s + 1] += 1
        n_present = 0
        for s in range(n_slots):
            n_present += starts[s + 1] > 0
            starts[s + 1] += starts[s]
        order = np.empty(starts[n_slots], np.int64)
        fill = starts[:n_slots].copy()
        for r in range(token_slots.shape[0]):
            s = token_slots[r]
            if s >= 0:
                order[fill[s]] = r
                fill[s] += 1
        present = np.empty(n_present, np.int64)
        p = 0
        for s in range(n_slots):
            if starts[s + 1] > starts[s]:
                present[p] = s
                p += 1
        return order, starts, present

    @njit(fastmath=True, cache=True, inline="always")
    def _shrink(x, a, scale, order, starts, present, xa, i0, i1, rank):  # pragma: no cover - compiled
        """xa[r, k] = A[s, k] . x[r] for work items i0..i1 of (present slot, A row k), slot-major: each
        A row read once for all the rows of its slot."""
        k_all, n_in = a.shape[1], a.shape[2]
        for i in range(i0, i1):
            s, k = present[i // k_all], i % k_all
            r0, r1 = starts[s], starts[s + 1]
            if scale[s, k // rank] == 0:  # a segment this adapter leaves out
                for j in range(r0, r1):
                    xa[order[j], k] = 0
                continue
            arow = a[s, k]
            for j in range(r0, r1):
                r = order[j]
                xa[r, k] = _dot(arow, x[r], n_in)

    @njit(fastmath=True, cache=True, inline="always")
    def _expand(b, scale, bounds, order, starts, present, xa, out, i0, i1):  # pragma: no cover - compiled
        """out[r, c] += scale[s, g] * (B[s, c] . xa[r, segment g]) for work items i0..i1 of (present
        slot, output column c), slot-major."""
        n_out, rank = b.shape[1], b.shape[2]
        i = i0
        while i < i1:
            p, c = i // n_out, i % n_out
            end = min(i1, (p + 1) * n_out)  # this slot's columns in the range
            s, c_end = present[p], c + (end - i)
            r0, r1 = starts[s], starts[s + 1]
            bs = b[s]
            for g in range(scale.shape[1]):
                lo, hi = max(c, bounds[g]), min(c_end, bounds[g + 1])
                sc = scale[s, g]
                if lo >= hi or sc == 0:
                    continue
                # the common ranks' dot with a constant length: unrolled, its vector in registers;
                # rows of the slot outer, so B[s, lo:hi] is read from memory once, then from cache
                for j in range(r0, r1):
                    r = order[j]
                    xg, orow = xa[r, g * rank : (g + 1) * rank], out[r]
                    if rank == 16:
                        for cc in range(lo, hi):
                            orow[cc] += _dot(bs[cc], xg, 16) * sc
                    elif rank == 8:
                        for cc in range(lo, hi):
                            orow[cc] += _dot(bs[cc], xg, 8) * sc
                    else:
                        for cc in range(lo, hi):
                            orow[cc] += _dot(bs[cc], xg, rank) * sc
            i = end

    @njit(parallel=True, fastmath=True, cache=True)
    def _lora_add(x, a, b, scale, bounds, token_slots, xa, out, threads):  # pragma: no cover - compiled
        """out += each row's adapter delta (the module docstring); xa [rows, >= segments * rank] scratch,
        bounds [>= segments + 1] the segments' output columns. No bank (a.shape[0] == 0): nothing."""
        if a.shape[0] == 0:
            return
        order, starts, present = _by_slot(token_slots, a.shape[0])
        active = order.shape[0]
        if active == 0:
            return
        k_all, n_in, n_out, rank = a.shape[1], a.shape[2], b.shape[1], b.shape[2]
        n_shrink, n_expand = present.shape[0] * k_all, present.shape[0] * n_out
        if threads == 1 or active * (k_all * n_in + n_out * rank) < PARALLEL_MACS:
            _shrink(x, a, scale, order, starts, present, xa, 0, n_shrink, rank)
            _expand(b, scale, bounds, order, starts, present, xa, out, 0, n_expand)
            return
        per = (n_shrink + threads - 1) // threads
        for t in prange(threads):
            _shrink(x, a, scale, order, starts, present, xa, t * per, min(n_shrink, (t + 1) * per), rank)
        per = (n_expand + threads - 1) // threads
        for t in prange(threads):
            _expand(b, scale, bounds, order, starts, present, xa, out, t * per, min(n_expand, (t + 1) * per))

    # no fastmath here: its vectorised exp compiles differently inside and outside a parallel loop,
    # and the bits must not depend on the thread count
    @njit(cache=True, inline="always")
    def _silu_cols(gate_up, out, lo, hi):  # pragma: no cover - compiled
        inter = out.shape[1]
        for r in range(out.shape[0]):
            for c in range(lo, hi):
                g = gate_up[r, c]
                out[r, c] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[r, inter + c]

    @njit(parallel=True, cache=True)
    def _silu_mul(gate_up, out, threads):  # pragma: no cover - compiled
        inter = out.shape[1]
        if threads == 1 or out.shape[0] * inter < PARALLEL_MACS // 8:  # ~8 multiply-adds' time an exp
            _silu_cols(gate_up, out, 0, inter)
            return
        per = (inter + threads - 1) // threads
        for t in prange(threads):
            _silu_cols(gate_up, out, t * per, min(inter, (t + 1) * per))
