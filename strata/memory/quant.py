"""Weight-only quantisation applied to a built model from outside (issue 4).

`quantize_model(model, "int8" | "int4", group_size)` replaces the dense projections (qkv_proj,
o_proj, gate_up_proj, down_proj in every layer, and lm_head) by QuantLinear modules holding the
formats of kernels/quant_formats.py, quantised from the loaded float weights. The model files do not
know about it: a QuantLinear answers the same calls as graph.layers.Linear (forward, and `swiglu`
for the fused gate/up epilogue).

Tied embeddings: when lm_head shares the embedding, the embedding is replaced too, by a
QuantEmbedding over the same quantised tensor that dequantises only the looked-up rows. Memory
keeps one (quantised) copy, and the input embedding is exactly the tied output matrix, as it was
in float. Untied embeddings stay float (a lookup reads a few rows, so quantising it would save
memory only, at some accuracy).

Norms, biases and an untied embedding stay in the model dtype. Everything the model keeps is
moved into one fresh numpy arena (huge pages, as the loader does), so the float arena the loader
filled is released and the memory it held shows up as free before the KV cache is sized.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from strata.kernels import ops, quant_formats
from strata.kernels.linear import quant_linear, quant_swiglu
from strata.memory.arena import rehome_in_arena

logger = logging.getLogger(__name__)

METHODS = quant_formats.METHODS
GROUP_SIZES = quant_formats.GROUP_SIZES
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
QUANT_CHUNK_ELEMENTS = 1 << 22  # weights quantised at a time: bounds the float temporaries (~100 MB)


class Layout(NamedTuple):
    """One projection's storage: method, group size (int8: 0 per row, 16 / 32 grouped) and
    whether its groups carry zero points (quant_formats: a GGUF's minima formats, exactly)."""

    method: str
    group_size: int
    zero: bool = False


def narrow_untied_embedding(checkpoint_dtype: torch.dtype, dtype: torch.dtype, tied: bool) -> bool:
    """Whether a quantised model keeps its untied embedding in bf16 (a WidenedEmbedding) rather
    than `dtype`: when the checkpoint stores it in bf16 and the model computes in fp32, the bf16
    matrix is exact and half the bytes (Llama-3.1-8B: 1.05 GB instead of 2.1)."""
    return not tied and dtype == torch.float32 and checkpoint_dtype == torch.bfloat16


def layer_format(method: str, in_features: int, group_size: int) -> tuple[str, int]:
    """(method, group size) one projection uses: int4 falls back to int8 when no group fits."""
    if method == "int4":
        g = quant_formats.int4_group_size(in_features, group_size)
        if g is not None:
            return "int4", g
        return "int8", 0
    return "int8", 0


def quantized_bytes(method: str, out_features: int, in_features: int, group_size: int) -> int:
    """Bytes of one quantised weight matrix (data + fp32 scales), as QuantLinear stores it."""
    return layout_bytes(Layout(*layer_format(method, in_features, group_size)), out_features, in_features)


def layout_bytes(layout: Layout, out_features: int, in_features: int) -> int:
    """Bytes of one weight matrix held in `layout` (a GGUF's or a prequantized checkpoint's)."""
    method, group, zero = layout
    if method == "int8" and not group:
        return out_features * in_features + 4 * out_features
    data = out_features * in_features // (1 if method == "int8" else 2)
    return data + 4 * out_features * (in_features // group) * (2 if zero else 1)


class QuantLinear(nn.Module):
    """A dense projection with a weight-only quantised weight (kernels/quant_formats.py)."""

    def __init__(
        self, method: str, qweight: torch.Tensor, scale: torch.Tensor, in_features: int,
        group_size: int, bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.method, self.in_features, self.group_size = method, in_features, group_size
        self.out_features = qweight.shape[0]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # a GPTQ act-order checkpoint's input column order (graph/prequantized.py): the weight's
        # columns are stored so its groups are runs, and the input is gathered to match
        self.register_buffer("input_perm", None)
        self._kernel_key: tuple[int, int] | None = None
        self._kernel_weights: tuple = ()

    @classmethod
    def empty(cls, method: str, out_features: int, in_features: int, group_size: int,
              bias: torch.Tensor | None, device: torch.device | str, grouped_int8: bool = False,
              zero: bool = False) -> QuantLinear:
        """An uninitialised QuantLinear of this shape (on `meta`: for the loader to place and fill).
        grouped_int8: int8 with a scale per `group_size` (16 or 32; 0: 32) columns (a GGUF's Q8_0,
        exactly) instead of per row. zero: grouped int8 / int4 whose groups have zero points too
        (scale [out, 2, groups]: quant_formats)."""
        if method == "int8" and grouped_int8:
            g = group_size or quant_formats.INT8_GROUP
            if g not in quant_formats.INT8_GROUPS or in_features % g:
                raise ValueError(f"grouped int8: group size {g} must be one of {quant_formats.INT8_GROUPS} "
                                 f"and divide in_features {in_features}")
            qweight = torch.empty(out_features, in_features, dtype=torch.int8, device=device)
        else:
            method, g = layer_format(method, in_features, group_size)
            if method == "int8":
                qweight = torch.empty(out_features, in_features, dtype=torch.int8, device=device)
                scale = torch.empty(out_features, dtype=torch.float32, device=device)
                return cls(method, qweight, scale, in_features, g, bias)
            qweight = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
        groups = (out_features, 2, in_features // g) if zero else (out_features, in_features // g)
        return cls(method, qweight, torch.empty(groups, dtype=torch.float32, device=device), in_features, g, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, method: str, group_size: int, grouped_int8: bool = False,
                    zero: bool = False) -> QuantLinear:
        w = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        q = cls.empty(method, linear.out_features, linear.in_features, group_size, bias, w.device, grouped_int8, zero)
        if w.device.type != "meta":
            q.quantize_rows(0, w)
        return q

    def quantize_rows(self, start: int, w: torch.Tensor) -> None:
        """Quantise float rows `w` into output rows [start, start + len(w)) of this weight, in place.

        In row chunks: the float temporaries of a whole vocabulary-sized lm_head would add ~2x its
        fp32 size to peak memory (and stay in the heap afterwards)."""
        step = max(1, QUANT_CHUNK_ELEMENTS // max(1, w.shape[1]))
        for i in range(0, w.shape[0], step):
            part = w[i : i + step]
            rows = slice(start + i, start + i + part.shape[0])
            zero = quant_formats.has_zero(self.scale)
            if not zero and ops.quantize_weight_rows(self.method, part, self.qweight[rows], self.scale[rows],
                                                     self.group_size):
                continue
            if self.method == "int8":
                q, s = quant_formats.quantize_int8(part, self.group_size if self.scale.dim() > 1 else 0)
            else:
                q, s = quant_formats.quantize_int4(part, self.group_size)
            self.qweight[rows].copy_(q)
            if zero:  # symmetric values in a layout with zero points: zero 0
                self.scale[rows, 0].copy_(s)
                self.scale[rows, 1].zero_()
            else:
                self.scale[rows].copy_(s)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight this module computes with (torch reference twin), in the input's own
        column order (an act-order weight's columns put back)."""
        if self.method == "int8":
            w = quant_formats.dequantize_int8_ref(self.qweight, self.scale, dtype)
        else:
            w = quant_formats.dequantize_int4_ref(self.qweight, self.scale, dtype)
        if self.input_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_perm, w)
        return w

    def kernel_weights(self) -> tuple:
        """(qweight, scale) as numpy views for the CPU kernels, cached until the buffers move."""
        key = (self.qweight.data_ptr(), self.scale.data_ptr())
        if key != self._kernel_key:
            self._kernel_weights = (self.qweight.numpy(), self.scale.numpy())
            self._kernel_key = key
        return self._kernel_weights

    def set_input_perm(self, perm: torch.Tensor) -> None:
        self.input_perm = perm.to(torch.int64).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        return quant_linear(x, self, self.bias)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up in one pass over a [gate; up] weight, or None where no kernel applies."""
        if self.bias is not None:
            return None
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        return quant_swiglu(x, self)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"{self.method}, in_features={self.in_features}, out_features={self.out_features}{g}"


class QuantEmbedding(nn.Module):
    """Embedding lookup over a tied, quantised lm_head: dequantises only the rows looked up."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head = [head]  # a list, so the head is not registered twice as a submodule
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        rows = None if self.dtype is not torch.float32 else ops.quant_embedding_rows(
            head.method, head.qweight, head.scale, ids, head.group_size)
        if rows is not None:
            return rows.view(*ids.shape, head.in_features)
        flat = ids.reshape(-1)
        q = head.qweight.index_select(0, flat)
        s = head.scale.index_select(0, flat)
        if head.method == "int8":
            rows = quant_formats.dequantize_int8_ref(q, s, self.dtype)
        else:
            rows = quant_formats.dequantize_int4_ref(q, s, self.dtype)
        return rows.view(*ids.shape, head.in_features)


def _release_heap() -> None:
    """Hand the quantisation temporaries back to the OS (glibc keeps freed heap otherwise: ~0.4
    GiB for qwen-0.5b), so free memory, and with it the KV cache, is measured without them."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def quantize_model(model: nn.Module, method: str, group_size: int = 64,
                   formats: dict[str, Layout] | None = None, only_formats: bool = False) -> nn.Module:
    """Replace the model's dense projections by QuantLinear modules, in place; returns the model.
    On a model built on `meta` the QuantLinears are left empty, for the loader to fill.

    method: "int8" (per-output-channel scales) or "int4" (group-wise scales over `group_size`
    input columns, two weights per byte). See the module docstring for tied embeddings.
    formats: the Layout by qualified projection name, in place of `method` there: a GGUF's own
    layouts (graph/gguf_model.gguf_formats); int8 with a group size there is grouped int8.
    only_formats: leave the projections `formats` does not name as they are (a prequantized
    checkpoint's unquantized lm_head, graph/prequantized.py).
    """
    formats = formats or {}
    if method not in METHODS:
        raise ValueError(f"quantization: unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size: must be one of {GROUP_SIZES}, got {group_size}")
    tied = (
        isinstance(getattr(model, "embed_tokens", None), nn.Embedding)
        and isinstance(getattr(model, "lm_head", None), nn.Linear)
        and model.lm_head.weight is model.embed_tokens.weight
    )
    dtype = next(model.parameters()).dtype
    fallback = 0
    with torch.no_grad():
        for prefix, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if child_name in PROJECTIONS and isinstance(child, nn.Linear):
                    name = f"{prefix}.{child_name}" if prefix else child_name
                    if only_formats and name not in formats:
                        continue
                    own, own_group, zero = formats.get(name, Layout(method, group_size))
                    grouped = name in formats and own == "int8" and own_group > 0
                    q = QuantLinear.from_linear(child, own, own_group, grouped_int8=grouped, zero=zero)
                    fallback += q.method != own
                    setattr(module, child_name, q)
        if tied and isinstance(model.lm_head, QuantLinear):
            model.embed_tokens = QuantEmbedding(model.lm_head, dtype)
    if fallback:
        logger.warning("int4: %d projection(s) have no group size dividing their columns; kept int8", fallback)
    rehome_in_arena(model)
    _release_heap()
    if formats:
        counts: dict[str, int] = {}
        for own, own_group, zero in formats.values():
            label = (f"{own} group {own_group}" if own_group else f"{own} per row") + (" with zero points" if zero else "")
            counts[label] = counts.get(label, 0) + 1
        logger.info("projections in the file's own layouts: %s", ", ".join(f"{v} {k}" for k, v in counts.items()))
    logger.info("quantized the dense projections to %s%s%s", method,
                f" (group size {group_size})" if method == "int4" else "",
                "; tied embedding dequantised per looked-up row" if tied else "")
    return model


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy (parameters + persistent buffers, shared ones once)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        items = list(module.named_parameters(recurse=False)) + [
            (n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set
        ]
        for _, t in items:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total

