"""Weight-only int8 / int4 storage formats and their torch reference twins.

- int8: `qweight` int8 [out, in], `scale` fp32 [out]; symmetric per output channel,
  w ~= qweight * scale with qweight in [-127, 127].
- int8 grouped (group_size 32 or 16: a GGUF's Q8_0 / Q5_0 / Q6_K read exactly; graph/
  gguf_weights.py): the same qweight, `scale` fp32 [out, in / group_size], one per group of input
  columns (llama.cpp's q8_0 block: its fp16 scale widened, its 32 int8 codes as they are).
- With a zero point ("asymmetric": a GGUF's Q4_1 / Q5_1 / Q4_K / Q5_K): `scale` fp32
  [out, 2, groups] holds each group's scale s (scale[:, 0]) and zero z (scale[:, 1]), and the
  weight is s * code - z, code the int8 value (int8 grouped) or nibble - 8 (int4). llama.cpp's
  minima formats are exactly this: a Q4_K group's s = d * sc, z = dmin * m; Q4_1's z = -m.
  The kernels compute sum(x * (s * code - z)) as s * sum(x * code) - z * sum(x) per group, the
  second term from each input row's group sums, in the same row loop (cpu_quant._int4z_gemv,
  _int8gz_gemv and their SwiGLU forms).
- int4: `qweight` uint8 [out, in / 2], `scale` fp32 [out, in / group_size]; symmetric per group of
  `group_size` input columns, w ~= (q - 8) * scale with q in [0, 15]. Two nibbles per byte, laid
  out per group: byte k of a group of L columns holds column k (low nibble) and column k + L/2
  (high nibble), so a kernel unpacks a run of bytes into two contiguous runs of columns (no
  shuffles). group_size divides the columns (see int4_group_size), so all groups are full.
  As in llama.cpp's q4_0, the scale maps the group's largest-magnitude value to -8 exactly, so
  all 16 levels are used.

Quantised once, at load, from the checkpoint's float weights. The dequantize_*_ref functions are
the reference twins of the CPU kernels in cpu_quant.py (dequantize, then F.linear).
"""

from __future__ import annotations

import torch

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


def int4_group_size(in_features: int, group_size: int) -> int | None:
    """The group size a layer with `in_features` columns uses: `group_size`, halved until it
    divides the columns (smol-135m's 576 columns take 64 when 128 is asked), never below 32;
    None when no such size divides them (that layer then stays int8)."""
    g = group_size
    while g > 32 and in_features % g:
        g //= 2
    return g if in_features % g == 0 else None


INT8_GROUP = 32  # grouped int8's usual group: a Q8_0 block
INT8_GROUPS = (16, 32)  # 16: a Q6_K file's sub-blocks


def has_zero(scale: torch.Tensor) -> bool:
    """Whether a grouped scale holds zero points too ([out, 2, groups]: module docstring)."""
    return scale.dim() == 3


def scales_and_zeros(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale [out, groups], zero [out, groups] or None) of a grouped scale tensor."""
    return (scale[:, 0], scale[:, 1]) if scale.dim() == 3 else (scale, None)


def quantize_int8(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) -> (int8 [out, in], fp32 scale [out]; group_size 32: [out, in / 32])."""
    w = w.detach().float()
    if group_size:
        n_out, n_in = w.shape
        wg = w.view(n_out, n_in // group_size, group_size)
        amax = wg.abs().amax(dim=2)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(wg / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(n_out, n_in)
        return q, scale
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (packed uint8 [out, in / 2], fp32 scale [out, in / group_size])."""
    n_out, n_in = w.shape
    if group_size % 2 or n_in % group_size:
        raise ValueError(
            f"int4: group_size {group_size} must be even and divide in_features {n_in}"
        )
    wg = w.detach().float().view(n_out, n_in // group_size, group_size)
    hi, lo = wg.amax(dim=2), wg.amin(dim=2)
    extreme = torch.where(hi >= -lo, hi, lo)  # the signed value of largest magnitude
    scale = torch.where(extreme != 0, extreme / -8.0, torch.ones_like(extreme))
    q = torch.round(wg / scale[..., None]).add_(8).clamp_(0, 15).to(torch.uint8)
    # each group's first half in the low nibbles, its second half in the high ones (byte order)
    q = q.view(n_out, n_in // group_size, 2, group_size // 2)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).view(n_out, n_in // 2)
    return packed.contiguous(), scale.contiguous()


def dequantize_int8_ref(
    qweight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    if scale.dim() >= 2:  # grouped (with zero points when 3-D)
        s, z = scales_and_zeros(scale)
        n_out, ng = s.shape
        w = qweight.to(torch.float32).view(n_out, ng, -1) * s[..., None]
        if z is not None:
            w = w - z[..., None]
        return w.view(n_out, -1).to(dtype)
    return (qweight.to(torch.float32) * scale[:, None]).to(dtype)


def dequantize_int4_ref(
    qweight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32
) -> torch.Tensor:
    """The float weight [out, in] that the int4 kernels compute with (any device)."""
    s, z = scales_and_zeros(scale)
    n_out, ng = s.shape
    packed = qweight.view(n_out, ng, -1)
    q = torch.cat(((packed & 15), (packed >> 4)), dim=2).to(torch.float32)
    w = (q - 8.0) * s[..., None]
    if z is not None:
        w = w - z[..., None]
    return w.view(n_out, -1).to(dtype)


def quantize_activations_ref(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [rows, in] as the int8-activation int4 kernel sees it, back in fp32: per row and group
    of `group_size` columns, scale = max|x| / 127 (1 for an all-zero group), q = round(x / scale)
    (half to even), returned as q * scale."""
    rows, n_in = x.shape
    xg = x.to(torch.float32).reshape(rows, n_in // group_size, group_size)
    amax = xg.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xg * (1.0 / scale)).clamp_(-127, 127)
    return (q * scale).reshape(rows, n_in)


def quantize_activations_q8_0_ref(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as the group-32 int8-activation kernels see it (int8 grouped and int4 group 32,
    the layouts of a GGUF's Q8_0 / Q4_0), back in fp32: llama.cpp's q8_0 block, per row and 32
    columns d = fp16(max|x| / 127), q = round(x * 127 / max|x|) (half to even; 0 for an all-zero
    block), returned as q * d. Matching llama.cpp's activation rounding keeps a GGUF's greedy tokens
    on llama.cpp's."""
    rows, n_in = x.shape
    xg = x.to(torch.float32).reshape(rows, n_in // 32, 32)
    amax = xg.abs().amax(dim=2, keepdim=True)
    d = (amax / 127.0).to(torch.float16).to(torch.float32)
    # tensor / tensor: an IEEE division, as llama.cpp's scalar 127.f / max (torch computes
    # scalar / tensor as a reciprocal times the scalar: one ulp off at times, flipping ties)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xg * inv).clamp_(-127, 127)
    return (q * d).reshape(rows, n_in)


def requantize_int4_ref(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weight [out, in] and per-row scale [out] the W8A8 prefill multiplies an int4 weight
    by (kernels/cpu_w8a8.py): per row S = max|scale| * 8 / 127 (1 for an all-zero row), each
    group's ratio scale / S in 16.16 fixed point f (rounded half to even), and a nibble q becomes
    ((q - 8) * f + 2^15) >> 16 (rounded half up). |int8 * S - (q - 8) * scale| <= S / 2 (+ the
    fixed point's 2^-17 of a step): at most half a step of the row's int8 grid, the rounding int8
    weights have themselves."""
    n_out, ng = scale.shape
    s = scale.to(torch.float32)
    row = s.abs().amax(dim=1) * torch.tensor(8.0 / 127.0, dtype=torch.float32)
    row = torch.where(row > 0, row, torch.ones_like(row))
    fixed = torch.round(s * (1.0 / row)[:, None] * 65536.0).to(torch.int64)
    packed = qweight.view(n_out, ng, -1)
    q = torch.cat(((packed & 15), (packed >> 4)), dim=2).to(torch.int64) - 8
    return ((q * fixed[..., None] + 32768) >> 16).to(torch.int8).view(n_out, -1), row
