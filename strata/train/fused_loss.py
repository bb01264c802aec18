"""The LM head and cross-entropy fused, a chunk of tokens at a time (the design of Liger-Kernel's
fused linear cross-entropy, in plain torch ops).

The unfused loss materialises the [tokens, vocab] logits, their log-softmax and, in backward,
the logits' gradient: three tensors the size of the whole batch's logits (4.5 GiB for smol-135m
at 8,192 tokens in fp32), each written and read again, each a fresh allocation the kernel must
fault in. Here the forward walks the tokens in chunks and, for each, computes the logits, the
loss and at once the gradients of the chunk's hidden states and of the head's weight (softmax
minus the one-hot target), reusing one logits buffer. Backward only scales the two saved
gradients by the incoming one. Same FLOPs as the unfused loss (the logits matmul and the two
gradient matmuls), nothing recomputed, and one chunk's logits live instead of the batch's.

The gradients equal the unfused ones up to float summation order (tests/train/test_fused_loss.py).
It needs grad mode (it computes the gradients in the forward): without it, and for heads it does
not cover (logit soft-capping), `LanguageModelLoss` runs the unfused loss.
"""

from __future__ import annotations

import torch

from strata.model_config import ModelConfig

IGNORE_INDEX = -100
CHUNK_LOGITS_BYTES = 256 * 2**20  # a chunk's fp32 logits at most this big ...
MIN_CHUNK_TOKENS = 512  # ... but never fewer tokens (each chunk reads and writes the head's gradient)


def fused_loss_applies(cfg: ModelConfig, fused: bool, loss_chunk_tokens: int) -> bool:
    """Whether the trainer runs the fused loss for this ModelConfig: asked for, not overridden by
    --loss-chunk-tokens, and a plain linear head (no logit soft-capping)."""
    return fused and not loss_chunk_tokens and cfg.final_logit_softcapping is None


def chunk_tokens_for(vocab_size: int, tokens: int) -> int:
    """Tokens per chunk: the fp32 logits of a chunk within CHUNK_LOGITS_BYTES."""
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, CHUNK_LOGITS_BYTES // (4 * vocab_size))))


class LinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of cross_entropy(hidden @ weight.T (+ bias), labels), and its
    gradients, computed in the forward. hidden [N, H]; weight [V, H]; labels [N] (IGNORE_INDEX:
    not counted). The matmuls run in `compute_dtype` (the autocast dtype, or the weight's), the
    softmax in fp32; the weight's gradient accumulates in fp32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, compute_dtype: torch.dtype, chunk: int) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(torch.float32)
            n = hidden.shape[0]
            grad_h = torch.empty_like(hidden)
            # a frozen head (LoRA) needs no weight gradient: skip its matmul and [V, H] buffer
            want_w = ctx.needs_input_grad[1]
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
            grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            shape = (min(chunk, n), weight.shape[0])  # one chunk's logits, reused by every chunk
            buf = torch.empty(shape, dtype=compute_dtype, device=hidden.device)
            buf32 = buf if compute_dtype == torch.float32 else torch.empty(shape, dtype=torch.float32, device=hidden.device)
            for start in range(0, n, chunk):
                h = hidden[start:start + chunk].to(compute_dtype)
                y = labels[start:start + chunk]
                rows = h.shape[0]
                raw = torch.mm(h, w.t(), out=buf[:rows])
                logits = raw if compute_dtype == torch.float32 else buf32[:rows].copy_(raw)
                if b is not None:
                    logits = logits + b
                valid = y != IGNORE_INDEX
                target = torch.where(valid, y, 0)
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, target[:, None]).squeeze(1)
                total += torch.where(valid, lse - picked, 0.0).sum()
                # d loss / d logits = softmax - one_hot(target), zero on ignored rows
                d = logits.sub_(lse[:, None]).exp_()
                d[torch.arange(rows, device=d.device), target] -= 1.0
                d.mul_(valid[:, None].to(d.dtype))
                if grad_b is not None:
                    grad_b += d.sum(0)
                dc = d if compute_dtype == torch.float32 else d.to(compute_dtype)
                grad_h[start:start + rows] = torch.mm(dc, w)
                if grad_w is None:
                    pass
                elif compute_dtype == torch.float32:
                    grad_w.addmm_(dc.t(), h)
                else:
                    grad_w += torch.mm(dc.t(), h)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.has_bias = bias is not None
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        g = grad_out.to(torch.float32)
        gh = grad_h * g.to(grad_h.dtype)
        gw = None if grad_w is None else grad_w * g
        return gh, gw, (grad_b * g if ctx.has_bias else None), None, None, None


def fused_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor,
                        chunk: int | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of head(hidden) against labels over the tokens not IGNORE_INDEX,
    as F.cross_entropy(head(hidden).float(), labels) computes it, fused (module docstring).
    `weight`: the head's weight in place of head.weight (a quantized head, dequantized)."""
    flat, y = hidden.flatten(0, -2), labels.flatten()
    weight = head.weight if weight is None else weight
    dev = flat.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    chunk = chunk or chunk_tokens_for(weight.shape[0], y.numel())
    total = LinearCrossEntropy.apply(flat, weight, head.bias, y, dtype, chunk)
    return total / (y != IGNORE_INDEX).sum()
