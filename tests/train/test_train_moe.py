"""Training a mixture of experts: the load-balancing loss is transformers' (function and model),
the z-loss ST-MoE's, the terms enter the objective with their coefficients, the router's load
evens out with the aux loss on and not without it, and `strata train` reports the histogram."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as mixtral_lb
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    load_balancing_loss_func as qwen2_moe_lb,
)
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

from strata.cli import main
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import TrainConfig
from strata.train.export import export_hf
from strata.train.model_init import build_model, resolve
from strata.train.moe_loss import (
    expert_counts,
    imbalance,
    load_balancing_loss,
    router_losses,
    router_z_loss,
)
from strata.train.trainer import LanguageModelLoss, Trainer
from tests.train.train_fixtures import metrics, train_argv


def _gate_logits(layers=3, tokens=24, experts=8, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, experts, generator=g) * 3 for _ in range(layers)]  # peaked, not uniform


@pytest.mark.parametrize("reference", [mixtral_lb, qwen2_moe_lb])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_aux_loss_equals_transformers_load_balancing_loss_func(reference, top_k):
    logits = _gate_logits()
    ours = load_balancing_loss(logits, 8, top_k)
    theirs = reference(tuple(logits), 8, top_k)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert abs(float(ours) - top_k) > 0.05  # peaked logits: not the uniform router's value


def test_aux_loss_with_an_attention_mask_equals_transformers():
    logits = _gate_logits(tokens=2 * 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0
    ours = load_balancing_loss(logits, 8, 2, mask)
    torch.testing.assert_close(ours, mixtral_lb(tuple(logits), 8, 2, mask), rtol=1e-6, atol=1e-6)
    assert not torch.isclose(ours, load_balancing_loss(logits, 8, 2))


def test_z_loss_equals_switch_transformers_router_z_loss():
    logits = _gate_logits()
    torch.testing.assert_close(router_z_loss(logits), router_z_loss_func(torch.cat(logits)[None]))


def test_counts_and_imbalance():
    logits = [torch.tensor([[5.0, 1, 0, 0], [5, 0, 1, 0], [5, 0, 0, 1]]),
              torch.tensor([[9.0, 0, 0, 8], [0, 9, 0, 8], [0, 0, 9, 8]])]
    counts = expert_counts(logits, 2)
    assert counts.tolist() == [[3, 1, 1, 1], [1, 1, 1, 3]]
    assert imbalance(counts) == pytest.approx(3 / 1.5)
    assert imbalance(torch.tensor([[2, 2, 2, 2]])) == 1.0


def _moe_model(d, seed=0, router_std=None):
    src = resolve(str(d / "config.json"), None)
    lm = build_model(src, seed, None)
    if router_std is not None:  # a peaked router, so the aux loss is far from its uniform value
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in lm.layers:
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * router_std)
    return src, lm


def _batch(seed=0, vocab=4000, shape=(2, 16)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g)


def test_the_models_aux_loss_equals_transformers_qwen3_moe(tiny_moe_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    src, lm = _moe_model(tiny_moe_dir, router_std=2.0)
    export = export_hf(lm, src.config, src.tokenizer_dir, tmp_path / "hf", 1, [2])
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    inputs, targets = _batch()
    loss_fn = LanguageModelLoss(lm, router=router_losses(lm, src.model_config.moe, None, None)).train()
    loss_fn(inputs, targets)
    with torch.no_grad():
        theirs = hf(input_ids=inputs, output_router_logits=True).aux_loss
    torch.testing.assert_close(loss_fn.router_stats.aux_loss, theirs, rtol=1e-5, atol=1e-5)
    assert loss_fn.router_stats.counts.sum(1).tolist() == [2 * inputs.numel()] * 2  # top 2, both layers


def test_the_terms_enter_the_objective_with_their_coefficients(tiny_moe_dir):
    src, lm = _moe_model(tiny_moe_dir, router_std=1.0)
    inputs, targets = _batch()
    plain = LanguageModelLoss(lm).train()(inputs, targets)
    loss_fn = LanguageModelLoss(lm, router=router_losses(lm, src.model_config.moe, 0.3, 0.02)).train()
    loss = loss_fn(inputs, targets)
    s = loss_fn.router_stats
    torch.testing.assert_close(s.lm_loss, plain.detach())
    torch.testing.assert_close(loss.detach(), s.lm_loss + 0.3 * s.aux_loss + 0.02 * s.z_loss)
    assert s.z_loss > 0
    assert all(layer.mlp.router_logits_sink is None for layer in lm.layers)  # taken off after the forward
    loss_fn.eval()
    torch.testing.assert_close(loss_fn(inputs, targets), plain)  # eval: the LM loss alone


def test_the_config_coefficient_is_the_default_and_a_flag_overrides_it(tiny_moe_dir):
    src, lm = _moe_model(tiny_moe_dir)
    assert router_losses(lm, src.model_config.moe, None, None).aux_coef == 0.01  # the fixture's config.json
    r = router_losses(lm, src.model_config.moe, 0.5, 1e-3)
    assert (r.aux_coef, r.z_coef, len(r.blocks)) == (0.5, 1e-3, 2)
    assert router_losses(lm, None, 0.5, None) is None  # a dense model


def test_an_moe_step_runs_under_bf16_autocast(tiny_moe_dir):
    src, lm = _moe_model(tiny_moe_dir, router_std=1.0)
    loss_fn = LanguageModelLoss(lm, router=router_losses(lm, src.model_config.moe, 0.1, 0.01)).train()
    inputs, targets = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 experts add into fp32 rows
        loss = loss_fn(inputs, targets)
    loss.backward()
    assert torch.isfinite(loss) and lm.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_full_activation_checkpointing_gives_the_same_moe_gradients(tiny_moe_dir):
    inputs, targets = _batch()

    def grads(mode):
        src, lm = _moe_model(tiny_moe_dir, router_std=1.0)
        apply_activation_checkpointing(lm, mode)
        loss_fn = LanguageModelLoss(lm, router=router_losses(lm, src.model_config.moe, 0.1, 0.01)).train()
        loss_fn(inputs, targets).backward()
        assert all(b.router_logits_sink is None for b in loss_fn.router.blocks)  # the recompute appends nothing
        prefix = "_checkpoint_wrapped_module."  # what torch's wrapper adds
        return {n.replace(prefix, ""): p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    a, b = grads("none"), grads("full")
    assert a.keys() == b.keys() and any("mlp.gate" in n for n in a)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=0, atol=0, msg=n)


def _badly_routed_run(d, out, coef):
    """30 steps of the tiny MoE whose routers start sending most tokens to experts 0 and 1: a
    constant component in every embedding (dimension 0) that those experts' router rows favour.
    Returns metrics.jsonl by step."""
    cfg = TrainConfig(model=str(d / "config.json"), data=[str(d / "train.txt")], out_dir=str(out), seq_len=32,
                      micro_batch_size=8, max_steps=30, warmup_steps=1, lr=2e-2, precision="float32",
                      num_workers=0, tensorboard=False, threads=1, resume=False, log_every=1, save_every=0,
                      router_aux_loss_coef=coef)
    trainer = Trainer(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        trainer.lm.embed_tokens.weight[:, 0] = 0.06
        for block in trainer.router.blocks:
            block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=g) * 0.3)
            block.gate.weight[:2, 0] += 1.5
    trainer.fit(progress=False)
    return metrics(out)


def test_the_expert_load_evens_out_with_the_aux_loss_and_not_without(tiny_moe_dir, tmp_path):
    # measured over seeds 0-11: start 3.4-3.9; the last 10 steps' mean 1.8-2.2 with the aux loss,
    # 3.1-3.9 without (the router collapses further): margins >= 0.9 where 0.5 is asked
    runs = {coef: _badly_routed_run(tiny_moe_dir, tmp_path / f"coef{coef}", coef) for coef in (0.0, 1.0)}

    def late(rows):
        return sum(rows[s]["expert_imbalance"] for s in range(21, 31)) / 10

    off, on = runs[0.0], runs[1.0]
    start = on[1]["expert_imbalance"]
    assert start == off[1]["expert_imbalance"] and start > 3.0
    assert late(on) < start - 0.5, (start, late(on))
    assert late(on) < late(off) - 0.5, (late(on), late(off))
    for rows in (off, on):
        assert rows[30]["loss"] < rows[1]["loss"] - 1.0  # and it trains
        assert all(r["aux_loss"] > 0 and r["z_loss"] > 0 for r in rows.values())
    assert on[30]["aux_loss"] < on[1]["aux_loss"]


def test_strata_train_on_the_named_moe_size_reports_the_histogram(tiny_train_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = train_argv(tiny_train_dir, out, "--model", "tiny-moe", "--max-steps", "3",
                      "--router-z-loss-coef", "1e-3", "--json")
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    load = summary["expert_load"]
    tokens = 32 * 2  # --seq-len x --micro-batch-size
    assert sum(load["first_step"]) == sum(load["last_step"]) == 2 * 2 * tokens  # top 2, 2 MoE layers
    assert len(load["first_step"]) == 8 and load["imbalance"][0] >= 1.0
    assert "tokens per expert" in captured.err and "first step" in captured.err
    assert (out / "expert_load.svg").read_text().lstrip().startswith("<?xml")
    rows = metrics(out)
    assert sorted(rows) == [1, 2, 3]
    for row in rows.values():
        assert row["aux_loss"] > 0 and row["z_loss"] > 0 and row["expert_imbalance"] >= 1.0
        assert sum(row["expert_load"]) == 2 * 2 * tokens
