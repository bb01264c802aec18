"""Building blocks of the decoder: RMSNorm with fused residual add, rotary embedding, MLP."""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from strata.graph import lora
from strata.kernels import ops
from strata.kernels.linear import linear, swiglu

logger = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through Strata's kernel dispatch (see kernels/linear.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up for a [gate; up] weight in one pass, or None where no fused kernel applies."""
        return None if self.bias is not None else swiglu(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm as in Llama; `forward(x, residual)` also adds the residual first (one pass less)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fast = ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fast is not None:
            return fast[0] if residual is None else fast
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        else:  # match HF: normalise in fp32, cast back, then scale
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 (scale = 1 + w), computed in fp32
    and cast back after scaling, exactly as transformers' Gemma3RMSNorm; `forward(x, residual)`
    adds the residual first, like RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return out if residual is None else (out, residual)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _longrope_inv_freq(inv_freq: torch.Tensor, s: dict, max_positions: int) -> torch.Tensor:
    """Phi-3's longrope: per-frequency divisors, the long set when the engine's context exceeds the
    pre-training length (transformers picks it when the sequence does: the two agree for every
    sequence when max_model_len <= original_max_position_embeddings, and for every sequence longer
    than it otherwise)."""
    long = max_positions > s["original_max_position_embeddings"]
    factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32, device=inv_freq.device)
    return inv_freq / factors


def _yarn_inv_freq(pos_freqs: torch.Tensor, s: dict, theta: float) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters, the same ops in the same order): frequencies
    that turn fewer than beta_slow times over the pre-training window are interpolated (divided by
    factor), those turning more than beta_fast times kept, a linear ramp between."""
    dim, orig = 2 * pos_freqs.shape[0], s["original_max_position_embeddings"]

    def turns_dim(turns: float) -> float:  # the dimension whose frequency turns `turns` times in orig
        return (dim * math.log(orig / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = turns_dim(s["beta_fast"]), turns_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency extrapolated (left as pre-trained)
    return (1.0 / (s["factor"] * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


@functools.cache  # once per engine context, not per table (the loader re-inits them on its device)
def _note_dynamic(seq: int, orig: int) -> None:
    logger.info("dynamic rope: every position uses transformers' base for a %d-token sequence (max_model_len); "
                "transformers rescales per forward, so shorter prompts differ from it (max_model_len <= %d: "
                "plain rotary, identical)", seq, orig)


def _dynamic_theta(theta: float, s: dict, dim: int, max_positions: int) -> float:
    """Dynamic NTK: the base transformers uses for a sequence of max_positions tokens (unchanged up
    to the pre-training length). One table for the engine's context, because the KV cache keeps
    keys rotated when written; transformers re-derives it from each forward's longest sequence, so
    the two agree for every sequence when max_model_len <= max_position_embeddings, and for a
    sequence of exactly max_model_len tokens otherwise (vLLM's table: max_model_len = factor x)."""
    orig, factor = s["original_max_position_embeddings"], s["factor"]
    seq = max(max_positions, orig)
    if seq > orig:
        _note_dynamic(seq, orig)
    return theta * ((factor * seq / orig) - (factor - 1)) ** (dim / (dim - 2))


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table; `head_dim`
    is the rotated width (Phi-4-mini rotates only the first dims of each head)."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.half = head_dim // 2
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_tables()

    def init_tables(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the cos/sin tables, e.g. after the model was materialised from `meta`."""
        d, cpu = self.head_dim, torch.device("cpu")  # explicit: may run under a meta-device context
        kind, theta = (self.scaling or {}).get("rope_type"), self.theta
        if kind == "dynamic":
            theta = _dynamic_theta(theta, self.scaling, d, self.max_positions)
        pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=cpu).float() / d)
        inv_freq = 1.0 / pos_freqs
        if kind == "linear":
            inv_freq = inv_freq / self.scaling["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.scaling)
        elif kind == "longrope":
            inv_freq = _longrope_inv_freq(inv_freq, self.scaling, self.max_positions)
        elif kind == "yarn":
            inv_freq = _yarn_inv_freq(pos_freqs, self.scaling, theta)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=cpu)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # longrope and yarn scale cos and sin (so every path that reads these tables honours it:
        # the eager step, the fused CPU decode, the Triton rotary kernel)
        gain = (self.scaling or {}).get("attention_factor") or 1.0
        self.cos = (emb.cos() * gain).to(device or cpu)
        self.sin = (emb.sin() * gain).to(device or cpu)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `positions` [..., T] as [..., T, 1, head_dim]; looked up once per step."""
        flat = positions.reshape(-1)  # index_select: far cheaper than advanced indexing on CPU
        shape = (*positions.shape, 1, self.cos.shape[-1])
        cos = self.cos.index_select(0, flat).view(shape).to(dtype)
        return cos, self.sin.index_select(0, flat).view(shape).to(dtype)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [..., T, heads, head_dim] (rotate-half convention, as HF Llama)."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], dims: int) -> torch.Tensor:
    """Rotate only the first `dims` of each head (Phi-4-mini's partial_rotary_factor); the rest pass."""
    return torch.cat((apply_rotary(x[..., :dims], rope), x[..., dims:]), dim=-1)


class GatedMLP(nn.Module):
    """Gated MLP, act(gate) * up, with gate and up projections fused into one matmul: SwiGLU (silu),
    or GeGLU with tanh-approximated gelu (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act != "silu":
            gate_up = lora.project(self.gate_up_proj, x)
            gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
            return lora.project(self.down_proj, F.gelu(gate, approximate="tanh") * up)
        # Linear or a quantised stand-in (memory/quant.py); with adapters on gate/up, unfused
        fused = None if lora.active(self.gate_up_proj) else self.gate_up_proj.swiglu(x)
        if fused is not None:
            return lora.project(self.down_proj, fused)
        gate_up = lora.project(self.gate_up_proj, x)
        gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
        return lora.project(self.down_proj, F.silu(gate) * up)
