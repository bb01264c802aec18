"""PEFT LoRA adapters on Strata's fused decoder: where each adapter tensor goes, the banks that hold
them (graph/lora.py), and reading an adapter's weights, checked against the base.

A PEFT tensor `base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight` names the HF module
`model.layers.3.self_attn.k_proj`; the loader's name map (graph/loader.checkpoint_targets) says
that module is rows [q, q + kv) of this model's fused qkv_proj, so k_proj is that bank's segment 1.
Adapters may target the attention projections and a dense MLP's (not MoE experts, not embeddings or
the LM head: refused by name).

On a tensor-parallel shard (graph/tensor_parallel.py) a Site still names the FULL module's shape
(what the adapter must match, so the errors are the same on every rank) plus what this rank keeps
of it: a column-parallel segment's output rows (B's rows), a row-parallel projection's input columns
(A's columns). The row-parallel bank sits on the projection's `inner`, before the all-reduce.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from strata.graph.layers import GatedMLP
from strata.graph.loader import checkpoint_targets
from strata.graph.lora import LoRABank
from strata.graph.safetensors_file import SafetensorsFile
from strata.graph.tensor_parallel import projection_cuts
from strata.graph.tensor_parallel_layers import RowParallelLinear
from strata.protocol.lora import WEIGHTS_FILE, AdapterConfig, LoRAError, read_adapter_config

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(frozen=True)
class Site:
    """Where an HF module's LoRA goes: the fused module (the one holding the weight: a row-parallel
    projection's inner), its segment, the HF module's full (in, out); on a tensor-parallel shard
    the output rows (`rows`) or input columns (`cols`) of it this rank keeps."""

    module: nn.Module
    segment: int
    in_features: int
    out_features: int
    rows: slice | None = field(default=None, hash=False)  # (slices: unhashable before Python 3.12)
    cols: slice | None = field(default=None, hash=False)

    @property
    def shard_out(self) -> int:
        """The segment's output rows in this rank's bank."""
        return self.out_features if self.rows is None else self.rows.stop - self.rows.start

    def shard(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a full (A [r, in], B [out, r])."""
        if self.cols is not None:
            a = a[:, self.cols].contiguous()
        if self.rows is not None:
            b = b[self.rows].contiguous()
        return a, b


def _holder(m: nn.Module) -> nn.Module:
    """The module whose weight a projection computes with (a bank's home): a row-parallel one's
    inner, so that its delta joins the partial sums before the all-reduce."""
    return m.inner if isinstance(m, RowParallelLinear) else m


def lora_sites(model: nn.Module) -> dict[str, Site]:
    """HF module name ("model.layers.0.self_attn.q_proj") -> its Site, for every projection an
    adapter may target."""
    allowed = set()
    for layer in model.layers:
        allowed.update((id(layer.self_attn.qkv_proj), id(layer.self_attn.o_proj)))
        if isinstance(layer.mlp, GatedMLP):
            allowed.update((id(layer.mlp.gate_up_proj), id(layer.mlp.down_proj)))
    by_module: dict[int, list[tuple[str, slice | None]]] = {}
    modules = {}
    for name, t in checkpoint_targets(model, model.config).items():
        if t.attr != "weight" or id(t.module) not in allowed:
            continue
        by_module.setdefault(id(t.module), []).append((name.removesuffix(".weight"), t.rows))
        modules[id(t.module)] = _holder(t.module)
    sites = {}
    for key, entries in by_module.items():
        m = modules[key]
        entries.sort(key=lambda e: 0 if e[1] is None else e[1].start)
        for seg, (hf, rows) in enumerate(entries):
            out = m.out_features if rows is None else rows.stop - rows.start
            sites[hf] = Site(m, seg, m.in_features, out)
    if getattr(model, "tensor_parallel", None) is not None:
        sites = _full_sites(model, sites)
    return sites


def _full_sites(model: nn.Module, sites: dict[str, Site]) -> dict[str, Site]:
    """A shard's sites (this rank's sizes) as the full model's, with the rows or columns kept."""
    cuts = projection_cuts(model)
    out = {}
    for hf, s in sites.items():
        cut = cuts[id(s.module)]
        if cut.rows is not None:  # column-parallel: this rank's rows of each segment
            out[hf] = Site(s.module, s.segment, s.in_features, cut.full_out[s.segment], rows=cut.rows[s.segment])
        else:  # row-parallel: this rank's input columns
            out[hf] = Site(s.module, s.segment, cut.full_in, s.out_features, cols=cut.cols)
    return out


def segments_of(module: nn.Module, sites: dict[str, Site]) -> list[tuple[int, int]]:
    """The output row ranges of `module`'s segments (in its bank: this rank's), in segment order."""
    segs = sorted((s.segment, s.shard_out) for s in sites.values() if s.module is module)
    bounds, lo = [], 0
    for _, n in segs:
        bounds.append((lo, lo + n))
        lo += n
    return bounds


def lora_dtype(choice: str, model: nn.Module) -> torch.dtype:
    """The banks' storage for EngineConfig.lora_dtype: auto = float32 where the first layer's qkv
    projection holds fp32 weights, else bfloat16 (a narrow base: fp32 adapters would stream more
    bytes a step than their precision is worth next to bf16/int8/int4 weights)."""
    if choice != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice]
    tensors = list(model.layers[0].self_attn.qkv_proj.state_dict().values())
    return torch.float32 if all(t.dtype == torch.float32 for t in tensors) else torch.bfloat16


def attach_banks(model: nn.Module, slots: int, rank: int, trainable: bool = False, dropout: float = 0.0,
                 only: set[str] | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Site]:
    """Give every LoRA site's module a bank of `slots` adapters of rank <= `rank` (`only`: just the
    modules holding these HF names), stored as `dtype`; returns the sites."""
    sites = lora_sites(model)
    done = set()
    for site in sites.values():
        m = site.module
        if id(m) in done or (only is not None and not any(s.module is m for n, s in sites.items() if n in only)):
            continue
        done.add(id(m))
        device = next(iter(m.buffers()), None)
        device = device.device if device is not None else m.weight.device
        m.lora = LoRABank(m.in_features, segments_of(m, sites), slots, rank, trainable, dropout, device, dtype)
    return {hf: s for hf, s in sites.items() if bank_present(s.module)}


def bank_present(m: nn.Module) -> bool:
    return m._modules.get("lora") is not None


@dataclass
class AdapterWeights:
    """An adapter read into host memory: per module, {segment: (A [r, in], B [out, r], scale)}."""

    name: str
    config: AdapterConfig
    modules: dict[int, tuple[nn.Module, dict[int, tuple[torch.Tensor, torch.Tensor, float]]]]
    nbytes: int

    @property
    def rank(self) -> int:
        return max((a.shape[0] for _, segs in self.modules.values() for a, _, _ in segs.values()), default=0)


def read_adapter(name: str, path: str | Path, model: nn.Module, sites: dict[str, Site], max_rank: int,
                 base_name: str | None = None) -> AdapterWeights:
    """Read and check an adapter against the base: config, tensor names, ranks, shapes, dtypes."""
    cfg = read_adapter_config(path, name)
    if cfg.base_model and base_name and Path(cfg.base_model).name != Path(base_name).name:
        logger.warning("LoRA adapter %s was trained on %s; serving it on %s (its shapes match)",
                       name, cfg.base_model, base_name)
    file = Path(path) / WEIGHTS_FILE
    try:
        f = SafetensorsFile(file)
    except Exception as e:  # ModelLoadError names the corruption
        raise LoRAError(f"LoRA adapter {name}: {e}") from None
    try:
        pairs: dict[str, dict[str, str]] = {}
        for t in f.names():
            m = _TENSOR.match(t)
            if m is None:
                raise LoRAError(_unknown_tensor(name, t))
            hf = m.group(1)
            pairs.setdefault(hf, {})[m.group(2)] = t
        if not pairs:
            raise LoRAError(f"LoRA adapter {name}: {file} holds no lora_A/lora_B tensors")
        modules: dict[int, tuple[nn.Module, dict]] = {}
        nbytes = 0
        for hf, ab in sorted(pairs.items()):
            site = sites.get(hf)
            if site is None:
                raise LoRAError(_unknown_module(name, hf, sites))
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoRAError(f"LoRA adapter {name}: {hf} has {'/'.join(sorted(ab))} but not both lora_A "
                                "and lora_B")
            a_shape, b_shape = f.shape(ab["lora_A"]), f.shape(ab["lora_B"])
            r = a_shape[0] if len(a_shape) == 2 else -1
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != site.in_features or \
                    b_shape != (site.out_features, r):
                raise LoRAError(
                    f"LoRA adapter {name}: {hf} lora_A {list(a_shape)} / lora_B {list(b_shape)} do not fit the "
                    f"base's {hf} [{site.out_features}, {site.in_features}] (want lora_A [r, {site.in_features}], "
                    f"lora_B [{site.out_features}, r]): the adapter was trained on another model")
            if r > max_rank:
                raise LoRAError(f"LoRA adapter {name}: rank {r} ({hf}) is above --max-lora-rank {max_rank}; "
                                f"start the engine with --max-lora-rank {_next_rank(r)}")
            for t in ab.values():
                if not f.dtype(t).is_floating_point:
                    raise LoRAError(f"LoRA adapter {name}: {t} is {f.dtype(t)}, not a float tensor")
            a = f.read_rows(ab["lora_A"], 0, r).to(torch.float32)
            b = f.read_rows(ab["lora_B"], 0, site.out_features).to(torch.float32)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # the whole, on every rank
                raise LoRAError(f"LoRA adapter {name}: {hf} holds NaN or infinite values")
            a, b = site.shard(a, b)
            nbytes += (a.numel() + b.numel()) * 4
            modules.setdefault(id(site.module), (site.module, {}))[1][site.segment] = (a, b, cfg.scale(r))
    finally:
        f.close()
    return AdapterWeights(name, cfg, modules, nbytes)


def _next_rank(r: int) -> int:
    return next(v for v in (8, 16, 32, 64, 128, 256, 512, 1 << 30) if v >= r)


def _unknown_tensor(name: str, t: str) -> str:
    if "lora_embedding" in t or "embed_tokens" in t:
        return (f"LoRA adapter {name}: {t} adapts the token embedding, which Strata does not support; retrain "
                "without embed_tokens in target_modules")
    if "magnitude" in t:
        return f"LoRA adapter {name}: {t} is a DoRA magnitude vector; DoRA adapters are not supported"
    return f"LoRA adapter {name}: tensor {t} is not a LoRA lora_A/lora_B weight"


def _unknown_module(name: str, hf: str, sites: dict[str, Site]) -> str:
    leaf = hf.rsplit(".", 1)[-1]
    if leaf in ("lm_head", "embed_tokens"):
        return f"LoRA adapter {name}: it adapts {hf}, which Strata does not support; retrain without {leaf}"
    if ".experts." in hf:
        return f"LoRA adapter {name}: it adapts MoE expert {hf}; LoRA on experts is not supported (attention only)"
    kinds = sorted({n.rsplit(".", 1)[-1] for n in sites})
    return (f"LoRA adapter {name}: module {hf} is not in the base model (or not a projection LoRA can target: "
            f"{', '.join(kinds)}): the adapter was trained on another model")
