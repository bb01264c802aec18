"""`strata train --lora`: low-rank adapters trained on a frozen base, written as a PEFT adapter.

The adapters live in the serving banks (graph/lora.py): one slot, its A and B trainable, attached
to the fused projections that hold the targeted HF modules (graph/lora_adapter.attach_banks), and
the forward runs inside `lora_batch(LoRABatch.every_row(0))`. Every base parameter is frozen, so
the optimizer, the gradients, DDP's buckets and the checkpoints hold the adapter alone.

Initialised as PEFT does: each targeted segment's A kaiming-uniform (a = sqrt(5), nn.Linear's
init), B zeros, so step 0 computes the base model exactly; the slot's scale is PEFT's alpha / r
(alpha / sqrt(r) with rsLoRA) on targeted segments and 0 on the others. A segment left out (k_proj
of a fused qkv_proj when only q and v are targeted) has zero A and B and a zero scale: its
gradients are exactly zero, AdamW moves a zero weight with zero moments by nothing (decay of 0 is
0), so it stays zero and the export leaves it out.

A quantized base (--quantization int8|int4, QLoRA-style): the projections are the engine's
QuantLinear (memory/quant.py). Its CPU kernels have no backward, so training gives each one a
forward that dequantizes and calls F.linear, and a backward that dequantizes again for the input's
gradient (`FrozenQuantLinear`): the exact gradient through the dequantized weight, nothing saved
but the module, the base never updated.

The export (`write_peft_adapter`) cuts the fused banks back into PEFT's per-module tensors
(`base_model.model.<hf module>.lora_A.weight` [r, in], `lora_B.weight` [out, r]) with the loader's
name map, and writes an adapter_config.json that peft's PeftModel.from_pretrained and Strata's
`--lora-modules` read as is.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from strata.errors import ConfigError
from strata.graph.lora import lora_scale
from strata.graph.lora_adapter import PEFT_PREFIX, Site, attach_banks, lora_sites
from strata.memory.quant import QuantLinear
from strata.protocol.lora import CONFIG_FILE, WEIGHTS_FILE
from strata.train.config import ALL_LINEAR, LORA_TARGETS, TrainConfig
from strata.train.export import atomic_dir

ADAPTER_FILE = "adapter.safetensors"  # a LoRA checkpoint's tensors (the banks, under their own names)


@dataclass(frozen=True)
class LoRASpec:
    """The adapter's hyperparameters (what a resumed run must share with the one it continues)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]  # as asked: PEFT names, or ("all-linear",)
    use_rslora: bool

    @classmethod
    def of(cls, cfg: TrainConfig) -> LoRASpec:
        return cls(cfg.lora_rank, float(cfg.lora_alpha), float(cfg.lora_dropout),
                   tuple(cfg.lora_target_modules), cfg.use_rslora)

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.use_rslora)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "target_modules": list(self.target_modules)}


def targeted_sites(sites: dict[str, Site], targets: tuple[str, ...], model_name: str) -> dict[str, Site]:
    """The LoRA sites whose HF module's last name is a target (PEFT's matching of a name list);
    "all-linear": every site (PEFT's all-linear leaves out the LM head, as Strata does)."""
    order = {name: i for i, name in enumerate(LORA_TARGETS)}
    kinds = sorted({hf.rsplit(".", 1)[-1] for hf in sites}, key=lambda k: (order.get(k, len(order)), k))
    if targets == (ALL_LINEAR,):
        return dict(sites)
    unknown = [t for t in targets if t not in kinds]
    if unknown:
        why = ("; LoRA on MoE experts, embeddings or the LM head is not supported"
               if any(t in ("gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head") for t in unknown) else "")
        raise ConfigError(
            f"--lora-target-modules {' '.join(unknown)}: {model_name} has no such projection LoRA can target"
            f"{why}; its targets are {' '.join(kinds)} (or {ALL_LINEAR} for all of them)")
    return {hf: s for hf, s in sites.items() if hf.rsplit(".", 1)[-1] in targets}


def freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def attach_trainable(model: nn.Module, spec: LoRASpec, seed: int, model_name: str = "the model") -> dict[str, Site]:
    """Freeze `model`, give its targeted projections one trainable slot, initialise it as PEFT
    does (module docstring); returns the targeted sites {HF module name: Site}."""
    freeze(model)
    chosen = targeted_sites(lora_sites(model), spec.target_modules, model_name)
    attach_banks(model, slots=1, rank=spec.rank, trainable=True, dropout=spec.dropout, only=set(chosen))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in chosen.values():  # model order: the same draws every run
            bank = site.module.lora
            a, _ = bank.segment_weights(0, site.segment)
            a.copy_(_kaiming_uniform(a.shape, g).to(a.device))
            bank.scale[0, site.segment] = spec.scale
    return chosen


def _kaiming_uniform(shape: torch.Size, g: torch.Generator) -> torch.Tensor:
    """nn.Linear's init of a [rank, in] weight (kaiming_uniform_ with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)))."""
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=g) * (2 * bound) - bound


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The banks' tensors (lora_a, lora_b, scale) under the model's own names: a LoRA checkpoint."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if ".lora." in k}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    want = set(adapter_state(model))
    if set(state) != want:
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        raise ConfigError(f"{where}: its adapter tensors do not fit this run's (missing {missing[:3]}, unexpected "
                          f"{extra[:3]}): resume with the same --lora-target-modules, or use a fresh --out-dir")
    own = model.state_dict()
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise ConfigError(f"{where}: {k} is {list(v.shape)}, this run's is {list(own[k].shape)}; resume with "
                              "the same --lora-rank, or use a fresh --out-dir")
    model.load_state_dict(state, strict=False)


# ---------------------------------------------------------------- the base


def base_name(model_arg: str, weights_dir: Path, named: bool) -> str:
    """base_model_name_or_path of the adapter: the checkpoint directory as the user named it; for a
    named size, the directory `strata serve` serves it from (demo: demo-v2, a random shape:
    random-<shape>-s0), whose name graph/lora_adapter.read_adapter compares with the base's."""
    return weights_dir.name if named else model_arg


def base_record(name: str, weights_dir: Path, cfg: TrainConfig) -> dict[str, Any]:
    """What identifies the frozen base a LoRA run trains on: resume refuses a different one. The
    weights are hashed whole (SHA-256 of every weight file; once per run, at the first checkpoint)."""
    h = hashlib.sha256()
    files = sorted(p for p in weights_dir.iterdir() if p.suffix in (".safetensors", ".gguf") or p.name == "config.json")
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return {"model": name, "sha256": h.hexdigest(),
            "quantization": cfg.quantization,
            "quantization_group_size": cfg.quantization_group_size if cfg.quantization else None}


# ---------------------------------------------------------------- a quantized frozen base


class _DequantLinear(torch.autograd.Function):
    """y = x @ dequantize(W).T (+ b) in the autocast dtype (as autocast casts an fp32 weight); the
    backward dequantizes again for dL/dx: nothing saved but the module."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: QuantLinear, bias: torch.Tensor | None) -> torch.Tensor:
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            w = q.dequantize(torch.float32).to(dtype)
            y = F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        ctx.q, ctx.dtype, ctx.x_dtype = q, dtype, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.q.dequantize(torch.float32).to(ctx.dtype)
        return (grad.to(ctx.dtype) @ w).to(ctx.x_dtype), None, None


class FrozenQuantLinear(QuantLinear):
    """A QuantLinear in a training graph: the dequantize-then-F.linear forward with an exact input
    gradient (never the CPU kernels, which have no backward); the fused swiglu steps aside."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _DequantLinear.apply(x, self, self.bias)
        return super().forward(x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        return None


def make_quantized_trainable(model: nn.Module) -> int:
    """Give every QuantLinear of `model` the training forward; how many there were."""
    n = 0
    for m in model.modules():
        if type(m) is QuantLinear:
            m.__class__ = FrozenQuantLinear
            n += 1
    return n


def head_weight(head: nn.Module) -> torch.Tensor:
    """The LM head's weight for the fused loss: the parameter, or a quantized head dequantized."""
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor):
        return w
    return head.dequantize(torch.float32)


# ---------------------------------------------------------------- the PEFT export


def peft_config(spec: LoRASpec, sites: dict[str, Site], base: str) -> dict[str, Any]:
    """adapter_config.json as peft (0.7 and later) writes it, keys it reads with no warning."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "inference_mode": True, "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": sorted({hf.rsplit(".", 1)[-1] for hf in sites}), "fan_in_fan_out": False,
        "bias": "none", "use_rslora": spec.use_rslora, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_tensors(sites: dict[str, Site], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """PEFT's tensors of slot 0, one A/B pair per targeted HF module, rank exactly the bank's."""
    out = {}
    with torch.no_grad():
        for hf, site in sorted(sites.items()):
            a, b = site.module.lora.segment_weights(0, site.segment)
            out[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous().clone()
            out[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = b.detach().to("cpu", dtype).contiguous().clone()
    return out


def write_peft_adapter(dest: Path, spec: LoRASpec, sites: dict[str, Site], base: str,
                       dtype: torch.dtype = torch.float32, extra: dict[str, Any] | None = None) -> Path:
    """The PEFT adapter directory (adapter_config.json + adapter_model.safetensors), written
    atomically: a temporary directory renamed over `dest`'s place. `extra`: a strata_train.json
    beside them (the run's record; peft and the server ignore it)."""
    with atomic_dir(dest) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(spec, sites, base), indent=2) + "\n", encoding="utf-8")
        save_file(peft_tensors(sites, dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if extra:
            (tmp / "strata_train.json").write_text(json.dumps(extra, indent=2) + "\n", encoding="utf-8")
    return Path(dest)
