"""The fused LM head + cross-entropy (strata/train/fused_loss.py) against its reference, the
unfused F.cross_entropy(F.linear(h, W, b).float(), y): the loss and every gradient, across
shapes, chunkings, ignored targets, bias, autocast; and in the trainer's loss module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from strata.train.fused_loss import (
    IGNORE_INDEX,
    LinearCrossEntropy,
    chunk_tokens_for,
    fused_cross_entropy,
)


def _pair(n: int, h: int, v: int, bias: bool, seed: int = 0, ignore: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    head = torch.nn.Linear(h, v, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.2)
        if bias:
            head.bias.copy_(torch.randn(v, generator=g))
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore] = IGNORE_INDEX
    return hidden, head, labels


def _grads(loss_fn, hidden, head, labels):
    x = hidden.clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss = loss_fn(x, head, labels)
    (loss * 3.0).backward()  # a non-unit incoming gradient
    out = [loss.detach(), x.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return out


def reference(x, head, labels):
    return F.cross_entropy(F.linear(x, head.weight, head.bias).float(), labels, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("n,h,v,chunk", [(1, 8, 5, None), (7, 16, 33, 3), (64, 24, 257, 64), (65, 24, 257, 16),
                                         (33, 40, 1000, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_the_unfused_loss(n, h, v, chunk, bias) -> None:
    hidden, head, labels = _pair(n, h, v, bias, ignore=0.2 if n > 1 else 0.0)
    want = _grads(reference, hidden, head, labels)
    got = _grads(lambda x, hd, y: fused_cross_entropy(x, hd, y, chunk), hidden, head, labels)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_target_ignored_is_nan_like_the_reference() -> None:
    hidden, head, labels = _pair(4, 8, 11, False)
    labels[:] = IGNORE_INDEX
    assert torch.isnan(fused_cross_entropy(hidden, head, labels)) and torch.isnan(reference(hidden, head, labels))


def test_bf16_autocast_close_to_the_unfused_autocast_loss() -> None:
    hidden, head, labels = _pair(96, 64, 500, False, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(reference, hidden, head, labels)
        got = _grads(lambda x, hd, y: fused_cross_entropy(x, hd, y, 40), hidden, head, labels)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    # both run the matmuls in bf16 (8 mantissa bits): the gradients agree to bf16 rounding
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=2e-3)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)


def test_chunk_size_bounds_the_logits() -> None:
    assert chunk_tokens_for(49152, 8192) == 1365  # 256 MiB of fp32 logits
    assert chunk_tokens_for(4160, 8192) == 8192  # a small vocabulary: one chunk
    assert chunk_tokens_for(10**7, 8192) == 512  # never fewer than 512 tokens
    assert chunk_tokens_for(49152, 100) == 100


def test_backward_only_scales_the_forwards_gradients() -> None:
    hidden, head, labels = _pair(10, 8, 13, False)
    total = LinearCrossEntropy.apply(hidden.requires_grad_(True), head.weight, None, labels, torch.float32, 4)
    (g_h,) = torch.autograd.grad(total * 2.0, hidden, retain_graph=True)
    (g_h1,) = torch.autograd.grad(total, hidden)
    torch.testing.assert_close(g_h, 2.0 * g_h1)


def _tiny_lm(softcap: float | None = None):
    from strata.graph.models.llama import CausalLM
    from strata.model_config import ModelConfig

    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 64,
        "tie_word_embeddings": True, "torch_dtype": "float32"})
    if softcap:  # as Gemma's configs set it
        cfg = dataclasses.replace(cfg, final_logit_softcapping=softcap)
    torch.manual_seed(0)
    lm = CausalLM(cfg)
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return lm


def test_trainer_loss_fused_equals_unfused_on_a_model() -> None:
    from strata.train.trainer import LanguageModelLoss

    lm = _tiny_lm()
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    results = []
    for fused in (False, True):
        lm.zero_grad(set_to_none=True)
        module = LanguageModelLoss(lm, fused=fused)
        assert module.fused == fused
        loss = module(inputs, targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: the unfused loss, same value
        torch.testing.assert_close(LanguageModelLoss(lm, fused=True)(inputs, targets), l0, rtol=1e-6, atol=1e-6)


def test_fused_is_off_where_it_does_not_apply() -> None:
    from strata.train.trainer import LanguageModelLoss

    assert not LanguageModelLoss(_tiny_lm(softcap=30.0), fused=True).fused  # soft-capped logits
    assert not LanguageModelLoss(_tiny_lm(), chunk_tokens=8, fused=True).fused  # --loss-chunk-tokens wins
