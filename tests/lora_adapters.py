"""PEFT LoRA adapters for the tiny test models, made by peft itself (its forward is the reference)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def targets_for(family: str) -> list[str]:
    """Every projection LoRA may target in the family's HF module names (MoE: attention only)."""
    if family in ("phi3", "phi4mini"):  # its checkpoints fuse q/k/v and gate/up already
        return ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    if family in ("mixtral", "qwen2moe", "qwen3moe", "olmoe"):
        return ATTENTION
    return ALL_LINEAR


def make_adapter(hf_model, out: Path, seed: int, r: int = 8, alpha: float = 16, targets: list[str] | None = None,
                 rslora: bool = False, family: str = "llama"):
    """Write a random (non-zero) LoRA adapter for `hf_model` into `out`; returns the PeftModel (on a
    copy: get_peft_model changes the model it wraps)."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or targets_for(family),
                          init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
    pm = peft.get_peft_model(copy.deepcopy(hf_model), cfg).eval()
    with torch.no_grad():  # peft's non-default init draws B small; make the adapter matter
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    pm.save_pretrained(str(out))
    return pm


@torch.no_grad()
def peft_greedy(pm, prompt: list[int], max_new: int, eos: int, adapter: bool = True) -> list[int]:
    """Greedy tokens from a loop over peft's forward (with its adapter, or with it disabled)."""
    ids, out = list(prompt), []
    ctx = pm.disable_adapter() if not adapter else torch.no_grad()
    with ctx:
        for _ in range(max_new):
            tok = int(pm(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out
