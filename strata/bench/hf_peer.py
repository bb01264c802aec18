"""The transformers peer: the same checkpoint and requests, run the way most people run HF.

Throughput: `generate` in static batches with left padding (no continuous batching).
Latency: one prefill forward, then a plain greedy loop over a DynamicCache.
transformers is a dev extra, imported only when a benchmark asks for `--compare hf`.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from strata.bench.common import sync
from strata.errors import StrataError

logger = logging.getLogger(__name__)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise StrataError(
            f"--compare hf needs transformers ({e}); pip install transformers "
            "(or pip install 'strata[dev]')"
        ) from None
    return transformers


def load_hf_model(path: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """AutoModelForCausalLM on the same directory and dtype as Strata, in eval mode."""
    tf = _transformers()
    t0 = time.perf_counter()
    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    logger.info("transformers loaded %s (%s) in %.2fs", path, dtype, time.perf_counter() - t0)
    return model


@dataclass
class HFThroughput:
    elapsed_s: float
    num_batches: int
    padded_output_tokens: int  # tokens computed for outputs, batch padding included


def hf_throughput(
    model: torch.nn.Module,
    prompts: list[list[int]],
    output_lens: list[int],
    batch_size: int,
    pad_token_id: int,
    device: str = "cpu",
    progress: bool = True,
) -> HFThroughput:
    """`generate` in static batches of `batch_size` (request order), left-padded, greedy.

    Each batch runs for its longest output (min_new_tokens = max_new_tokens, so EOS never stops
    it early); a request is credited only with its own output length.
    """
    padded = 0
    batches = [range(i, min(i + batch_size, len(prompts))) for i in range(0, len(prompts), batch_size)]
    bar = tqdm(total=len(prompts), desc="hf generate", unit="req", disable=not progress)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for idx in batches:
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                n = len(prompts[i])
                ids[row, width - n:] = torch.tensor(prompts[i])
                mask[row, width - n:] = 1
            new = max(output_lens[i] for i in idx)
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_token_id,
            )
            if out.shape[1] - width != new:
                raise StrataError(f"transformers generated {out.shape[1] - width} tokens, expected {new}")
            padded += new * len(idx)
            bar.update(len(idx))
    sync(device)
    elapsed = time.perf_counter() - t0
    bar.close()
    return HFThroughput(elapsed, len(batches), padded)


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` (transformers >= 5.x) or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class HFLatency:
    prefill_s: float
    decode_s: float
    decode_steps: int


def hf_latency(
    model: torch.nn.Module, prompts: list[list[int]], output_len: int, device: str = "cpu",
    progress: bool = True,
) -> HFLatency:
    """One forward over the (equal-length) prompts, then `output_len - 1` greedy decode steps.

    The prefill yields the first output token, as in Strata, so both count the same decode steps.
    """
    tf = _transformers()
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    steps = output_len - 1
    key = _cache_kwarg(model)
    with torch.inference_mode():
        kv = {key: tf.DynamicCache()}
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, **kv, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        t1 = time.perf_counter()
        for _ in tqdm(range(steps), desc="hf decode", unit="step", disable=not progress, leave=False):
            out = model(input_ids=tok, **kv, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        t2 = time.perf_counter()
    return HFLatency(t1 - t0, t2 - t1, steps)
