"""One configuration of `strata bench train`, alone in its own process: warm-up steps, then timed
steps, then one JSON line on stdout.

A process per configuration because peak memory on CPU is ru_maxrss, a peak over the process's
whole life: a configuration measured after another would report the larger of the two. Two
engines train the same shapes on the same random tokens (the same windows, in the same order):

  strata  strata.train's Trainer built from a TrainConfig (its own loss, AdamW, clipping,
          precision and activation checkpointing), stepped with train_step()
  hf      the loop someone writes by hand: transformers' LlamaForCausalLM / Qwen2ForCausalLM
          built from the same config.json, torch.optim.AdamW with its defaults, torch.autocast
          when not fp32 (and GradScaler for fp16), model(input_ids, labels=input_ids,
          use_cache=False).loss, backward, clip_grad_norm_(1.0), step, zero_grad (activation
          checkpointing "full": HF's gradient_checkpointing_enable, non-reentrant)

Every step is timed between device synchronisations. Errors are one JSON line {"error": ...}
and exit 2 (a configuration problem) or 1 (anything else, with its traceback on stderr).

  python -m strata.bench.train_worker --json --engine hf --model tiny --seq-len 32 --batch 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from strata.bench.common import sync
from strata.errors import ConfigError, StrataError
from strata.kernels.dispatch import reference_kernels
from strata.train.config import ACTIVATION_CHECKPOINTING, PRECISIONS, TrainConfig
from strata.train.data import PackedWindows, batch_for
from strata.train.metrics import peak_memory_bytes
from strata.train.model_init import resolve
from strata.train.precision import resolve_precision

ENGINES = ("strata", "hf")
PEER_ACTIVATION_CHECKPOINTING = ("none", "full")  # what a plain HF loop can do (gradient_checkpointing_enable)
LR = TrainConfig.lr  # both engines; the speed of a step does not depend on it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="strata")
    p.add_argument("--model", default="smol-135m", help="named size, config.json or HF checkpoint directory")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (micro batch)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--precision", choices=PRECISIONS, default="auto")
    p.add_argument("--activation-checkpointing", choices=ACTIVATION_CHECKPOINTING, default="none")
    p.add_argument("--loss-chunk-tokens", type=int, default=0, help="strata: LM head + loss in chunks (0 = off)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the token data")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (what the bench reads)")


# ------------------------------------------------------------------ shared by both engines


def random_windows(vocab_size: int, seq_len: int, count: int, seed: int) -> PackedWindows:
    """`count` windows of uniform random token ids, read by both engines in the same order."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size, (count * seq_len + 1,), generator=g)
    return PackedWindows(stream, seq_len, seed, "random tokens")


def batch_at(windows: PackedWindows, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) the Trainer reads at `step` (one process, no accumulation)."""
    first = batch_for(step, 0, 0, micro_batch=batch, grad_accum=1, world_size=1)
    return windows.samples(first, batch)


def time_steps(step: Callable[[], float], warmup: int, steps: int, device: str) -> tuple[list[float], list[float]]:
    """(seconds of each timed step, loss of every step); each step between two device syncs."""
    seconds, losses = [], []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(step())
        sync(device)
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
    return seconds, losses


def compute_dtype(precision: str, device: str) -> torch.dtype:
    return resolve_precision(precision, device)[0]


# ------------------------------------------------------------------ strata


def _bench_trainer_class():
    from strata.train.trainer import (
        Trainer,  # only the strata run loads it: the hf run's peak memory is its own
    )

    class BenchTrainer(Trainer):
        def _peak_flops(self) -> float:
            return 0.0  # the bench computes MFU from one probe in its own process; never probe here

    return BenchTrainer


PLACEHOLDER_WORD = "data"


def write_placeholder_tokenizer(directory: Path) -> Path:
    """A two-word tokenizer.json in `directory`: the steps read random token ids, so no text is ever
    tokenized but the placeholder below, and a vocabulary this small fits every model (the demo
    tokenizer's 4160 ids do not fit the 'tiny' shape's 1024)."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = tokenizers.Tokenizer(WordLevel({"<unk>": 0, PLACEHOLDER_WORD: 1}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def resolve_with_placeholder(model: str, directory: Path):
    """strata.train.model_init.resolve() on the placeholder tokenizer (ModelSource)."""
    return resolve(model, str(write_placeholder_tokenizer(directory)))


def _placeholder_text(seq_len: int) -> str:
    """seq_len + 2 tokens: the Trainer wants --data to build; its steps then read the random windows
    that replace it."""
    return f"{PLACEHOLDER_WORD}\n" * (seq_len + 2)


def run_strata(a: argparse.Namespace) -> dict[str, Any]:
    trainer_class = _bench_trainer_class()
    with tempfile.TemporaryDirectory(prefix="strata-bench-train-") as tmp:
        data = Path(tmp) / "placeholder.txt"
        data.write_text(_placeholder_text(a.seq_len), encoding="utf-8")
        tokenizer = write_placeholder_tokenizer(Path(tmp))
        cfg = TrainConfig(
            model=a.model, tokenizer=str(tokenizer), data=[str(data)], seq_len=a.seq_len, micro_batch_size=a.batch, grad_accum=1,
            num_workers=0, seed=a.seed, max_steps=a.warmup + a.steps, warmup_steps=0, lr=LR,
            precision=a.precision, activation_checkpointing=a.activation_checkpointing,
            loss_chunk_tokens=a.loss_chunk_tokens, out_dir=str(Path(tmp) / "out"), save_every=0, resume=False, tensorboard=False,
            threads=a.threads, device=a.device,
        )
        start_memory = peak_memory_bytes(a.device)
        trainer = trainer_class(cfg)
        trainer.data = random_windows(trainer.model_config.vocab_size, a.seq_len,
                                      (a.warmup + a.steps) * a.batch, a.seed)
        with reference_kernels():  # the CPU fast paths are inference-only (no backward), as in fit()
            seconds, losses = time_steps(lambda: trainer.train_step().loss, a.warmup, a.steps, a.device)
        info = {"compute_dtype": trainer.precision.name, "params": trainer.model_config.num_params(),
                "checkpointed_layers": trainer.num_checkpointed}
        return _result(a, seconds, losses, start_memory, info)


# ------------------------------------------------------------------ the plain PyTorch loop


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(f"the hf peer needs transformers ({e}); pip install transformers, or --peer none") from None
    return transformers


def build_hf_model(config: dict[str, Any], seed: int) -> torch.nn.Module:
    """transformers' model class named by config.json's architectures, from the same dict, fp32."""
    tf = _transformers()
    arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    cls = getattr(tf, arch, None)
    if cls is None:
        raise ConfigError(f"transformers {tf.__version__} has no {arch}; update transformers, or --peer none")
    torch.manual_seed(seed)
    return cls(cls.config_class.from_dict(config)).float()


def run_hf(a: argparse.Namespace) -> dict[str, Any]:
    if a.activation_checkpointing not in PEER_ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"--activation-checkpointing {a.activation_checkpointing}: a plain HF loop has no "
                          f"such mode; the hf peer runs {' or '.join(PEER_ACTIVATION_CHECKPOINTING)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="strata-bench-train-") as tmp:
        src = resolve_with_placeholder(a.model, Path(tmp))
    if a.seq_len > src.model_config.max_position_embeddings:
        raise ConfigError(f"--seq-len {a.seq_len} exceeds the model's max_position_embeddings "
                          f"({src.model_config.max_position_embeddings})")
    dtype = compute_dtype(a.precision, a.device)
    _transformers()  # imported before the memory baseline, as the Trainer's imports are
    start_memory = peak_memory_bytes(a.device)
    model = build_hf_model(src.config, a.seed).to(a.device).train()
    if a.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    device_type = torch.device(a.device).type
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)  # fp16 needs loss scaling
    windows = random_windows(src.model_config.vocab_size, a.seq_len, (a.warmup + a.steps) * a.batch, a.seed)
    step_index = 0

    def step() -> float:
        nonlocal step_index
        inputs, _ = batch_at(windows, step_index, a.batch)  # HF shifts the labels itself
        inputs = inputs.to(a.device)
        step_index += 1
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=inputs, labels=inputs, use_cache=False).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    seconds, losses = time_steps(step, a.warmup, a.steps, a.device)
    info = {"compute_dtype": str(dtype).replace("torch.", ""), "params": src.model_config.num_params(),
            "checkpointed_layers": src.model_config.num_layers if a.activation_checkpointing == "full" else 0}
    return _result(a, seconds, losses, start_memory, info)


# ------------------------------------------------------------------ result and entry point


def _result(a: argparse.Namespace, seconds: list[float], losses: list[float], start_memory: int,
            info: dict[str, Any]) -> dict[str, Any]:
    peak = peak_memory_bytes(a.device)
    return {
        "engine": a.engine, "model": a.model, "precision": a.precision,
        "activation_checkpointing": a.activation_checkpointing, "seq_len": a.seq_len, "batch": a.batch,
        "warmup": a.warmup, "steps": a.steps, "threads": torch.get_num_threads(), "device": a.device,
        "tokens_per_step": a.batch * a.seq_len, "step_seconds": seconds, "losses": losses,
        "peak_memory_bytes": peak, "start_memory_bytes": start_memory,
        "train_memory_bytes": max(0, peak - start_memory), **info,
    }


def _check(a: argparse.Namespace) -> None:
    for flag, value, low in (("--seq-len", a.seq_len, 1), ("--batch", a.batch, 1), ("--steps", a.steps, 1),
                             ("--warmup", a.warmup, 0)):
        if value < low:
            raise ConfigError(f"{flag}: must be >= {low}, got {value}")
    if a.threads is not None and a.threads < 1:
        raise ConfigError(f"--threads: must be >= 1, got {a.threads}")


def run(a: argparse.Namespace) -> dict[str, Any]:
    _check(a)
    return run_strata(a) if a.engine == "strata" else run_hf(a)


def _emit(a: argparse.Namespace, record: dict[str, Any]) -> None:
    if a.json:
        print(json.dumps(record), flush=True)
    elif "error" in record:
        print(f"error: {record['error']}", file=sys.stderr)
    else:
        median = sorted(record["step_seconds"])[len(record["step_seconds"]) // 2]
        print(f"{record['engine']}: {record['tokens_per_step'] / median:,.0f} tokens/s (median step "
              f"{median * 1e3:.1f} ms), peak memory {record['peak_memory_bytes'] / 2**20:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.train_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        record = run(a)
    except (StrataError, ValueError) as e:  # a configuration problem: its message is the report
        _emit(a, {"error": str(e)})
        return 2
    except torch.OutOfMemoryError:
        _emit(a, {"error": f"out of memory on {a.device}; lower --batch or --seq-len, or use "
                           "--activation-checkpointing full"})
        return 1
    except Exception as e:  # anything else: one line for the bench, the traceback for whoever debugs it
        traceback.print_exc(file=sys.stderr)
        _emit(a, {"error": f"{type(e).__name__}: {e}"})
        return 1
    _emit(a, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
