"""QLoRA-style `strata train --lora --quantization int8|int4`: the loss and the adapter's gradients
on a quantized frozen base equal those of an fp32 model built on the dequantized weights (the
gradient flows through the dequantized base to every layer's input); a run never changes the
base, and the adapter it writes serves on the same quantized base with the trained logits (the
same arithmetic exactly; the CPU int8 kernels within their own rounding)."""

from __future__ import annotations

import pytest
import torch

from strata.graph.loader import load_model
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.lora_adapter import attach_banks, read_adapter
from strata.kernels.dispatch import reference_kernels
from strata.memory.quant import QuantLinear
from strata.train.lora import (
    FrozenQuantLinear,
    LoRASpec,
    attach_trainable,
    make_quantized_trainable,
)
from strata.train.trainer import LanguageModelLoss, Trainer
from tests.train.test_train_lora import IDS, lora_config, make_base

SPEC = LoRASpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("all-linear",), use_rslora=False)


@pytest.fixture(scope="module")
def tiny_base(tiny_train_dir, tmp_path_factory):
    return make_base(tiny_train_dir, tmp_path_factory.mktemp("qlora") / "base", seed=0)


def _with_adapter(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable slot, B moved off zero (seeded) so every A has a gradient too."""
    attach_trainable(model, SPEC, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            if p.abs().sum() == 0:  # the B matrices
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return params


def _loss_and_grads(model, params, inputs, targets, fused: bool):
    loss_fn = LanguageModelLoss(model, fused=fused)
    with reference_kernels(), lora_batch(LoRABatch.every_row(0)):
        loss = loss_fn(inputs, targets)
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-loss", "unfused-loss"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_grads_through_a_quantized_base_equal_the_dequantized_fp32_model(tiny_base, method, fused):
    quant = load_model(tiny_base, torch.float32, storage=method, group_size=32).train()
    assert make_quantized_trainable(quant) > 0
    ref = load_model(tiny_base, torch.float32).train()
    with torch.no_grad():  # the reference: fp32 weights equal to the quantized ones, dequantized
        for name, m in quant.named_modules():
            if isinstance(m, QuantLinear):
                ref.get_submodule(name).weight.copy_(m.dequantize(torch.float32))
    for p in ref.parameters():
        p.requires_grad_(False)
    rows = torch.randint(0, 1000, (2, 25), generator=torch.Generator().manual_seed(0))
    inputs, targets = rows[:, :-1], rows[:, 1:]
    q_loss, q_grads = _loss_and_grads(quant, _with_adapter(quant), inputs, targets, fused)
    r_loss, r_grads = _loss_and_grads(ref, _with_adapter(ref), inputs, targets, fused)
    torch.testing.assert_close(q_loss, r_loss, rtol=1e-6, atol=1e-6)
    assert len(q_grads) == len(r_grads) == 2 * 2 * 4  # A and B of 4 fused projections in 2 layers
    for a, b in zip(q_grads, r_grads, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_qlora_run_leaves_the_base_alone_and_serves_on_it(tiny_train_dir, tiny_base, tmp_path):
    trainer = Trainer(lora_config(tiny_train_dir, tiny_base, tmp_path / "run", quantization="int8",
                                  lora_target_modules=["all-linear"], precision="bfloat16", max_steps=3))
    quantized = [m for m in trainer.lm.modules() if isinstance(m, QuantLinear)]
    assert quantized and all(isinstance(m, FrozenQuantLinear) for m in quantized)
    before = {k: v.clone() for k, v in trainer.lm.state_dict().items() if ".lora." not in k}
    result = trainer.fit(progress=False)
    assert result.steps == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    after = trainer.lm.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    export = trainer.export(tmp_path / "adapter")

    lm = trainer.lm.eval()
    with torch.no_grad(), reference_kernels(), lora_batch(LoRABatch.every_row(0)):
        own = lm.compute_logits(lm(IDS, torch.arange(IDS.shape[1])[None]))[0]
    served = load_model(tiny_base, torch.float32, storage="int8")  # `strata serve --quantization int8`
    sites = attach_banks(served, slots=1, rank=4)
    weights = read_adapter("q", export, served, sites, max_rank=4)
    for module, segments in weights.modules.values():
        module.lora.set_slot(0, segments)
    with torch.no_grad(), reference_kernels(), lora_batch(LoRABatch.every_row(0)):
        got = served.compute_logits(served(IDS, torch.arange(IDS.shape[1])[None]))[0]
    torch.testing.assert_close(got, own, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), lora_batch(LoRABatch.every_row(0)):  # the CPU int8 kernels: their own rounding
        fast = served.compute_logits(served(IDS, torch.arange(IDS.shape[1])[None]))[0]
    torch.testing.assert_close(fast, own, rtol=0, atol=0.05)
