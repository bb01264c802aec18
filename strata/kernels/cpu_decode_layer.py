"""One decoder layer of a CPU decode step in one numba call.

The eager decode step calls ~8 kernels per layer (norm, qkv GEMV, rotary + KV write, paged
attention, o GEMV, norm, SwiGLU GEMV, down GEMV), each behind a Python wrapper that checks
shapes, allocates its output and takes numpy views: measured on smol-135m (30 layers), 4.3 ms of
a 27 ms fp32 step outside any kernel and ~25 us per tiny norm call, most of it wrapper. Here the
same numba kernels run back to back inside one compiled function, on buffers the caller
allocated once for the step, so a layer costs one dispatch. The parallel kernels (GEMVs,
attention) keep their own thread split: numba runs a parallel callee's prange in parallel
from a serial caller.

Each projection's kernel is picked by its weight's storage dtype when numba compiles the layer
(one cached specialisation per weight format: fp32, bf16, int8, grouped int8, int4, and the
grouped formats with zero points) and, for the int8
formats, the int8-activation (VNNI) variant by the same rules as the eager dispatch, so the
results equal the eager path's bit for bit.

LoRA (`lora_layer`, `moe_attention_lora`): the same layer with each row's adapter added to every
projection that has a bank (kernels/cpu_lora.py), where the eager decoder adds it: after the
bias, before the q/k norms and the residual add; with a bank on gate_up the SwiGLU runs unfused
(project, add, silu * up) as the eager MLP does then. Only steps where some row has an adapter
take it; the others run `_layer` as before.

Reference twin: the eager layer (graph/models/llama.DecoderLayer with the same kernels, and with
the kernel mode's fast paths off, the torch reference ops); tests compare all three.
"""

from __future__ import annotations

import numpy as np

from strata.kernels.dispatch import kernel

try:
    import numba
    from numba import njit

    from strata.kernels import (
        cpu_attention,
        cpu_bf16,
        cpu_gemv,
        cpu_lora,
        cpu_norm,
        cpu_quant,
        cpu_rope,
    )
except ImportError:  # pragma: no cover - exercised only where numba is absent
    numba = None

MAX_ROWS = 16  # the few-row kernels' limit (cpu_gemv.MAX_ROWS and its peers)


def available() -> bool:
    return numba is not None


if numba is not None:
    from numba import types
    from numba.extending import overload

    def project(w, s, x, out, group, vnni, threads):
        """out = x @ W.T for the weight format W's storage dtype names (numba only)."""

    def project_swiglu(w, s, x, out, group, vnni, threads):
        """out = silu(x @ gate.T) * (x @ up.T) for a [gate; up] weight (numba only)."""

    # The weight's storage dtype picks the kernel at compile time (fp32 float32, bf16 bit
    # patterns int16, int8 int8, packed int4 uint8); `vnni` picks the int8-activation variant at
    # run time. Plain functions, not function arguments: numba cannot cache a function that takes
    # another as an argument (its type names the process's dispatcher object).
    def _by_dtype(dt, scale_dims, f32, bf16, int8, int8_vnni, int8g, int8g_vnni, int4, int4_vnni, int8gz, int4z):
        """The implementation for one weight storage dtype (and, for int8, per-row or grouped
        scales; 3-D scales: with zero points), from that projection's kernels."""
        if scale_dims == 3 and dt == types.int8:
            return lambda w, s, x, out, group, vnni, threads: int8gz(w, s, x, out, vnni, threads)
        if scale_dims == 3 and dt == types.uint8:
            return lambda w, s, x, out, group, vnni, threads: int4z(w, s, x, out, group, vnni, threads)
        if dt == types.float32:
            return lambda w, s, x, out, group, vnni, threads: f32(w, x, out, threads)
        if dt == types.int16:
            return lambda w, s, x, out, group, vnni, threads: bf16(w, x, out, threads)
        if dt == types.int8 and scale_dims == 2:
            def int8g_impl(w, s, x, out, group, vnni, threads):
                if vnni:
                    int8g_vnni(w, s, x, out, threads)
                else:
                    int8g(w, s, x, out, threads)
            return int8g_impl
        if dt == types.int8:
            def int8_impl(w, s, x, out, group, vnni, threads):
                if vnni:
                    int8_vnni(w, s, x, out, threads)
                else:
                    int8(w, s, x, out, threads)
            return int8_impl
        if dt == types.uint8:
            def int4_impl(w, s, x, out, group, vnni, threads):
                if vnni:
                    int4_vnni(w, s, x, out, group, threads)
                else:
                    int4(w, s, x, out, group, threads)
            return int4_impl
        return None

    @overload(project)
    def _project(w, s, x, out, group, vnni, threads):
        return _by_dtype(w.dtype, s.ndim, cpu_gemv._gemv_rows, cpu_bf16._bf16_gemv, cpu_quant._int8_gemv,
                         cpu_quant._int8_gemv_vnni, cpu_quant._int8g_gemv, cpu_quant._int8g_gemv_vnni,
                         cpu_quant._int4_gemv, cpu_quant._int4_gemv_vnni, cpu_quant._int8gz_gemv,
                         cpu_quant._int4z_gemv)

    @overload(project_swiglu)
    def _project_swiglu(w, s, x, out, group, vnni, threads):
        return _by_dtype(w.dtype, s.ndim, cpu_gemv._gemv_swiglu, cpu_bf16._bf16_swiglu, cpu_quant._int8_swiglu,
                         cpu_quant._int8_swiglu_vnni, cpu_quant._int8g_swiglu, cpu_quant._int8g_swiglu_vnni,
                         cpu_quant._int4_swiglu, cpu_quant._int4_swiglu_vnni, cpu_quant._int8gz_swiglu,
                         cpu_quant._int4z_swiglu)

    @njit(cache=True)
    def _add_bias(out, bias):  # pragma: no cover - compiled
        for j in range(out.shape[0]):
            for c in range(out.shape[1]):
                out[j, c] += bias[c]

    @njit(cache=True)
    def _norm_span(a, r, start, n, w, eps):  # pragma: no cover - compiled
        """a[r, start:start+n] RMS-normed in place, as cpu_norm._add_rms_norm computes a row."""
        ss = np.float32(0.0)
        for c in range(n):
            v = a[r, start + c]
            ss += v * v
        scale = np.float32(1.0) / np.sqrt(ss / np.float32(n) + eps)
        for c in range(n):
            a[r, start + c] = a[r, start + c] * scale * w[c]

    @njit(cache=True)
    def _qk_norm(qkv, qn, kn, heads, kv_heads, d, eps, whole, clip):  # pragma: no cover - compiled
        """q/k RMSNorms in place: per head (Qwen3), or over the whole q and k projections (OLMoE,
        which then clamps q, k and v to [-clip, clip] when clip > 0)."""
        q_size, kv_size = heads * d, kv_heads * d
        for r in range(qkv.shape[0]):
            if whole:
                _norm_span(qkv, r, 0, q_size, qn, eps)
                _norm_span(qkv, r, q_size, kv_size, kn, eps)
            else:
                for hh in range(heads):
                    _norm_span(qkv, r, hh * d, d, qn, eps)
                for hh in range(kv_heads):
                    _norm_span(qkv, r, q_size + hh * d, d, kn, eps)
            if clip > 0:
                for c in range(qkv.shape[1]):
                    qkv[r, c] = min(max(qkv[r, c], -clip), clip)

    @njit(cache=True)
    def _attn_qkv(x, residual, has_residual, ln1, eps, wqkv, sqkv, bqkv, gqkv, vqkv, threads, h, qkv,
                  res_out):  # pragma: no cover - compiled
        """The input norm (h, the residual stream in res_out), then qkv = h @ Wqkv.T (+ bias)."""
        if has_residual:
            cpu_norm._add_rms_norm(x, residual, ln1, eps, h, res_out, True)
        else:
            res_out[:] = x
            cpu_norm._add_rms_norm(res_out, res_out, ln1, eps, h, res_out, False)
        project(wqkv, sqkv, h, qkv, gqkv, vqkv, threads)
        if bqkv.shape[0]:
            _add_bias(qkv, bqkv)

    @njit(cache=True)
    def _attn_core(k_cache, v_cache, eps, wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole,
                   clip, cos, sin, slots, tables, lens, threads, qkv, q3, attn3, attn, o):  # pragma: no cover
        """q/k norms, rotary + KV write, paged attention, then o = attn @ Wo.T (+ bias)."""
        if qn.shape[0]:
            _qk_norm(qkv, qn, kn, heads, kv_heads, q3.shape[2], eps, qk_whole, clip)
        cpu_rope._rope_store(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads, q3)
        cpu_attention._paged_decode(q3, k_cache, v_cache, tables, lens, scale, window, attn3)
        project(wo, so, attn, o, go, vo, threads)
        if bo.shape[0]:
            _add_bias(o, bo)

    @njit(cache=True)
    def _attend(
        x, residual, has_residual, k_cache, v_cache,
        ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv, wo, so, bo, go, vo, heads, kv_heads, scale, window,
        qn, kn, qk_whole, clip,
        cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, res_out,
    ):  # pragma: no cover - compiled
        """The layer up to its MLP: leaves the normed MLP input in h, the residual stream in res_out."""
        _attn_qkv(x, residual, has_residual, ln1, eps, wqkv, sqkv, bqkv, gqkv, vqkv, threads, h, qkv, res_out)
        _attn_core(k_cache, v_cache, eps, wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole,
                   clip, cos, sin, slots, tables, lens, threads, qkv, q3, attn3, attn, o)
        cpu_norm._add_rms_norm(o, res_out, ln2, eps, h, res_out, True)  # in place: each element read first

    @njit(cache=True)
    def _attend_lora(
        x, residual, has_residual, k_cache, v_cache,
        ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv, wo, so, bo, go, vo, heads, kv_heads, scale, window,
        qn, kn, qk_whole, clip,
        token_slots, xa, bounds, aqkv, bqkv_lora, sqkv_lora, ao, bo_lora, so_lora,
        cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, res_out,
    ):  # pragma: no cover - compiled
        """_attend with each row's adapter added to qkv and o, after their biases (as graph/lora.project
        adds it to the module's output), before the q/k norms and the residual add."""
        _attn_qkv(x, residual, has_residual, ln1, eps, wqkv, sqkv, bqkv, gqkv, vqkv, threads, h, qkv, res_out)
        cpu_lora._lora_add(h, aqkv, bqkv_lora, sqkv_lora, bounds[0], token_slots, xa, qkv, threads)
        _attn_core(k_cache, v_cache, eps, wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole,
                   clip, cos, sin, slots, tables, lens, threads, qkv, q3, attn3, attn, o)
        cpu_lora._lora_add(attn, ao, bo_lora, so_lora, bounds[1], token_slots, xa, o, threads)
        cpu_norm._add_rms_norm(o, res_out, ln2, eps, h, res_out, True)

    @njit(cache=True)
    def _layer(
        x, residual, has_residual, k_cache, v_cache,
        # the layer's own (platform/cpu_layers.py builds these per layer): norms, then per projection
        # (weight, scale, bias, group, vnni); attention shape; q/k norms (empty: none)
        ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv, wo, so, bo, go, vo, wgu, sgu, ggu, vgu,
        wd, sd, bd, gd, vd, heads, kv_heads, scale, window, qn, kn, qk_whole, clip,
        # the step's: rotary rows, KV slots and tables, thread count, scratch and output buffers
        cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, act, out, res_out,
    ):  # pragma: no cover - compiled
        _attend(x, residual, has_residual, k_cache, v_cache, ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv,
                wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole, clip,
                cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, res_out)
        project_swiglu(wgu, sgu, h, act, ggu, vgu, threads)
        project(wd, sd, act, out, gd, vd, threads)
        if bd.shape[0]:
            _add_bias(out, bd)

    @njit(cache=True)
    def _lora_layer(
        x, residual, has_residual, k_cache, v_cache,
        ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv, wo, so, bo, go, vo, wgu, sgu, ggu, vgu,
        wd, sd, bd, gd, vd, heads, kv_heads, scale, window, qn, kn, qk_whole, clip,
        # the adapters (platform/cpu_layers.py): the step's token slots (filled every step), shrink
        # scratch, the banks' segment bounds [4, segments + 1], then per projection (qkv, o,
        # gate_up, down) the bank's A, B and scale (cpu_lora.NO_BANK: none), and the gate_up scratch
        token_slots, xa, bounds, aqkv, bqkv_lora, sqkv_lora, ao, bo_lora, so_lora, agu, bgu, sgu_lora,
        ad, bd_lora, sd_lora, gate_up,
        cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, act, out, res_out,
    ):  # pragma: no cover - compiled
        """_layer with each row's adapter on every projection that has a bank. With one on gate_up
        the SwiGLU must see gate and up with their deltas: project into `gate_up`, add, then
        silu(gate) * up (the eager MLP's unfused form when an adapter is active)."""
        _attend_lora(x, residual, has_residual, k_cache, v_cache, ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv,
                     wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole, clip,
                     token_slots, xa, bounds, aqkv, bqkv_lora, sqkv_lora, ao, bo_lora, so_lora,
                     cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, res_out)
        if agu.shape[0]:
            project(wgu, sgu, h, gate_up, ggu, vgu, threads)
            cpu_lora._lora_add(h, agu, bgu, sgu_lora, bounds[2], token_slots, xa, gate_up, threads)
            cpu_lora._silu_mul(gate_up, act, threads)
        else:
            project_swiglu(wgu, sgu, h, act, ggu, vgu, threads)
        project(wd, sd, act, out, gd, vd, threads)
        if bd.shape[0]:
            _add_bias(out, bd)
        cpu_lora._lora_add(act, ad, bd_lora, sd_lora, bounds[3], token_slots, xa, out, threads)

    @njit(cache=True)
    def _moe_layer(
        x, residual, has_residual, k_cache, v_cache,
        ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv, wo, so, bo, go, vo, heads, kv_heads, scale, window,
        qn, kn, qk_whole, clip,
        cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, act, out, res_out,
    ):  # pragma: no cover - compiled
        """An MoE layer's attention half (the router and experts follow: kernels/cpu_moe.py)."""
        _attend(x, residual, has_residual, k_cache, v_cache, ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv,
                wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole, clip,
                cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, res_out)

    @njit(cache=True)
    def _moe_lora_layer(
        x, residual, has_residual, k_cache, v_cache,
        ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv, wo, so, bo, go, vo, heads, kv_heads, scale, window,
        qn, kn, qk_whole, clip,
        token_slots, xa, bounds, aqkv, bqkv_lora, sqkv_lora, ao, bo_lora, so_lora,
        cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, act, out, res_out,
    ):  # pragma: no cover - compiled
        """_moe_layer with adapters on its attention projections (the experts take none)."""
        _attend_lora(x, residual, has_residual, k_cache, v_cache, ln1, ln2, eps, wqkv, sqkv, bqkv, gqkv, vqkv,
                     wo, so, bo, go, vo, heads, kv_heads, scale, window, qn, kn, qk_whole, clip,
                     token_slots, xa, bounds, aqkv, bqkv_lora, sqkv_lora, ao, bo_lora, so_lora,
                     cos, sin, slots, tables, lens, threads, h, qkv, q3, attn3, attn, o, res_out)

    @njit(cache=True)
    def shared_expert(h, wgu, sgu, ggu, vgu, wd, sd, gd, vd, gate, act, ys, threads, out):  # pragma: no cover
        """out += sigmoid(h @ gate) * mlp(h): Qwen2-MoE's shared expert on every row."""
        project_swiglu(wgu, sgu, h, act, ggu, vgu, threads)
        project(wd, sd, act, ys, gd, vd, threads)
        for r in range(h.shape[0]):
            g = np.float32(0.0)
            for c in range(h.shape[1]):
                g += h[r, c] * gate[c]
            g = np.float32(1.0) / (np.float32(1.0) + np.exp(-g))
            for c in range(out.shape[1]):
                out[r, c] += g * ys[r, c]

    llama_layer = _layer  # the Llama-shaped layer's run (decode_layers' calling convention)
    lora_layer = _lora_layer  # the same with adapters (a step where some row has one)
    moe_attention = _moe_layer  # an MoE layer's attention half, same convention (out left untouched)
    moe_attention_lora = _moe_lora_layer  # the same with adapters on its attention projections


def uses_vnni(fmt: str, n_in: int, rows: int, group: int) -> bool:
    """Whether a projection of this format runs its int8-activation kernel at `rows` input rows,
    by the rules the eager dispatch follows (cpu_quant.int8_int8 / int8_activations)."""
    if fmt == "int8":  # grouped int8 (by 16 or 32) quantises its activations per 32 columns
        return cpu_quant.int8_int8(n_in, 32 if group else 0)
    return fmt == "int4" and cpu_quant.int8_activations(rows, group, n_in)


@kernel("decode_layer")
def decode_layers(x, layers, step: tuple) -> None:
    """Every layer of the step in turn, `layers` holding each layer's (run, args): layer 0 reads x
    (the embedding), each later one the step's `out` / `res_out`, where the last leaves the MLP
    branch and the residual stream. A layer runs as run(x, residual, has_residual, *args, *step):
    `llama_layer` (the compiled Llama-shaped layer, args = (k_cache, v_cache, *its own)), or
    whatever the layer's kind gave the platform's decode step (platform/cpu_layers.py), an eager
    layer included. One Python loop with nothing else per layer: the per-layer argument checks
    happen once per step (platform/cpu_decode_step.py)."""
    out, res_out = step[-2], step[-1]
    residual, has_residual = x, False
    for run, args in layers:
        run(x, residual, has_residual, *args, *step)
        x, residual, has_residual = out, res_out, True


@kernel("add_rms_norm")
def final_norm(x, residual, weight, eps, out) -> None:
    """out = rms_norm(x + residual) * weight over numpy rows (the model's last norm; no residual out)."""
    cpu_norm._add_rms_norm(x, residual, weight, eps, out, residual, True)


@kernel("decode_head")
def final_norm_head(x, residual, weight, eps, hidden, head: tuple, threads: int, logits) -> None:
    """final_norm into `hidden`, then logits = hidden @ head.T (+ bias), in one compiled call;
    `head` is the LM head's (weight, scale, bias, group, vnni) as the layers' projections take them."""
    _norm_head(x, residual, weight, eps, hidden, *head, threads, logits)


if numba is not None:

    @njit(cache=True)
    def _norm_head(x, residual, weight, eps, hidden, w, s, b, group, vnni, threads, logits):  # pragma: no cover
        cpu_norm._add_rms_norm(x, residual, weight, eps, hidden, residual, True)
        project(w, s, hidden, logits, group, vnni, threads)
        if b.shape[0]:
            _add_bias(logits, b)


NO_ARRAY = np.empty(0, np.float32)  # an absent bias or scale


def advance_rows(positions: np.ndarray, tables: np.ndarray, block_size: int, slots: np.ndarray,
                 lens: np.ndarray) -> None:
    """Multi-step decode, in place: every row one position on, with its KV slot (from its block
    table [rows, blocks]) and its context length (position + 1). int64 arrays. One compiled call:
    the ~8 small numpy ops it replaces cost ~70 us a step right after the weights streamed through
    the caches."""
    if numba is None:  # pragma: no cover - exercised only where numba is absent
        positions += 1
        slots[:] = tables[np.arange(len(positions)), positions // block_size] * block_size + positions % block_size
        lens[:] = positions + 1
        return
    _advance_rows(positions, tables, block_size, slots, lens)


if numba is not None:

    @njit(cache=True)
    def _advance_rows(positions, tables, block_size, slots, lens):  # pragma: no cover - compiled
        for i in range(positions.shape[0]):
            p = positions[i] + 1
            positions[i] = p
            slots[i] = tables[i, p // block_size] * block_size + p % block_size
            lens[i] = p + 1
