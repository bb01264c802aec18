"""Shared pieces of the `strata bench` commands: model choice, random prompts, tables, JSON."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strata.engine.args import EngineArgs
from strata.errors import ConfigError
from strata.protocol.sampling_params import SamplingParams


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Engine flags (EngineArgs: shared with `strata generate` and `serve`) plus --compare/--json."""
    EngineArgs.add_cli_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--compare", choices=["hf"], default=None,
                   help="also run the same requests through transformers in this process")
    g.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE as JSON")


def resolve_model(args: argparse.Namespace) -> str | None:
    """Checkpoint directory from --model / --random-model; None selects the demo model."""
    return EngineArgs.from_cli_args(args).model_path()


def bench_engine_kwargs(args: argparse.Namespace, need_len: int, num_seqs: int) -> dict:
    """Engine kwargs from the flags, with max_model_len / max_num_seqs trimmed to the workload.

    Unset --max-model-len becomes the longest request, and max_num_seqs never exceeds the number
    of requests; neither changes scheduling, but both shrink the default KV cache reservation.
    """
    kw = EngineArgs.from_cli_args(args).all_kwargs()
    if kw["max_model_len"] is None:
        kw["max_model_len"] = need_len
    elif kw["max_model_len"] < need_len:
        raise ConfigError(
            f"--max-model-len {kw['max_model_len']} is shorter than the longest request "
            f"(input + output = {need_len} tokens); raise it or shorten --input-len/--output-len"
        )
    kw["max_num_seqs"] = max(1, min(kw["max_num_seqs"], num_seqs))
    return kw


def warm_capture(engine: Any) -> None:
    """With --compile / --cuda-graphs: compile or capture the decode step before anything is timed."""
    if engine.runner.decode_step is not None:
        engine.runner.decode_step.warm_up()


def capture_stats(engine: Any) -> dict | None:
    """torch.compile / CUDA-graph counters of the run (compilations, graphs, batch buckets used)."""
    cap = engine.runner.decode_step
    return None if cap is None else cap.stats()


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """'32:512' -> (32, 512) inclusive; '128' -> (128, 128)."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if lo < 1 or hi < lo:
        raise ConfigError(f"{flag}: expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def special_ids(engine: Any) -> set[int]:
    """Token ids a random prompt should avoid: BOS, EOS and the tokenizer's special tokens."""
    ids = set(engine.eos_token_ids)
    if engine.model_config.bos_token_id is not None:
        ids.add(int(engine.model_config.bos_token_id))
    if engine.tokenizer is not None:
        ids |= {int(i) for i in engine.tokenizer.all_special_ids}
    return ids


def random_prompts(
    rng: np.random.Generator, vocab_size: int, lengths: list[int], avoid: set[int]
) -> list[list[int]]:
    """One prompt per length, token ids uniform over the vocabulary minus `avoid`."""
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(avoid, dtype=np.int64, count=len(avoid)))
    if allowed.size == 0:
        allowed = np.arange(vocab_size)
    return [allowed[rng.integers(0, allowed.size, size=n)].tolist() for n in lengths]


def sync(device: str) -> None:
    """Wait for queued device work so wall-clock timings are honest."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else float("nan")


def _finite(v: Any) -> Any:
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def write_json(path: str | None, data: dict) -> None:
    if path is None:
        return
    Path(path).write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}")


def add_repeat_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--repeats", type=int, default=3,
                   help="timed runs per engine (default 3); tables show the median and the spread "
                   "(max - min) / median of each rate")


def add_sampling_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: top_p of every request (default 1: off)")
    g.add_argument("--top-k", type=int, default=-1, help="top_k of every request (default -1: off)")


def sampling_params(args: argparse.Namespace, max_tokens: int):
    """The workload's SamplingParams: --temperature / --top-p / --top-k, ignoring EOS (every
    request runs to max_tokens whatever it samples)."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=max_tokens, ignore_eos=True)


def sampling_note(args: argparse.Namespace) -> str:
    """'greedy', or the sampling flags as the header prints them."""
    if args.temperature == 0:
        return "greedy"
    return f"sampled (temperature {args.temperature:g}, top_p {args.top_p:g}, top_k {args.top_k})"


def check_sampling_args(args: argparse.Namespace) -> None:
    """Refuse bad sampling flags before a model loads. --compare hf runs transformers' greedy
    loop: a sampled Strata run beside it would time different work."""
    sampling_params(args, 1)  # SamplingParams' own checks (its messages name the field)
    if args.compare == "hf" and (args.temperature != 0 or args.top_p != 1.0 or args.top_k != -1):
        raise ConfigError("--compare hf runs transformers greedily; drop --temperature/--top-p/--top-k "
                          "or run without --compare")


def median_of_runs(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """The median run's figures (per key), the spread of each key across runs, and the runs."""
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0] if isinstance(runs[0][k], int | float)}
    out["spread"] = {k: spread([r[k] for r in runs]) for k in keys}
    out["runs"] = runs
    return out


def spread(values: list[float]) -> float:
    """(max - min) / median: how far repeated measurements of one quantity disagree."""
    mid = float(np.median(values))
    return (max(values) - min(values)) / mid if mid > 0 else float("nan")


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


UNSTABLE_BANDWIDTH = 0.2  # memory bandwidth before vs after a run differing by more: flagged
UNSTABLE_SPREAD = 0.15  # repeated runs of one rate disagreeing by more: flagged


def stability_notes(bw_before: float, bw_after: float, load_before: float, load_after: float, busy_threads: int,
                    spreads: dict[str, dict[str, float]]) -> list[str]:
    """Why a measurement should not be trusted, if it should not: the machine's memory bandwidth
    moved during it, other processes loaded the cores, or the repeats disagree."""
    notes = []
    if min(bw_before, bw_after) > 0 and abs(bw_after - bw_before) / max(bw_before, bw_after) > UNSTABLE_BANDWIDTH:
        notes.append(f"memory bandwidth moved during the run ({bw_before:.1f} -> {bw_after:.1f} GB/s)")
    cores = os.cpu_count() or 1
    others = max(load_before, load_after) - busy_threads  # the load this benchmark adds itself
    if others == others and others > 0.5 * cores:
        notes.append(f"other processes loaded the CPU (load average {load_before:.1f} -> {load_after:.1f} "
                     f"on {cores} cores, {busy_threads} of it ours)")
    for engine, s in spreads.items():
        wide = {k: v for k, v in s.items() if v == v and v > UNSTABLE_SPREAD}
        if wide:
            notes.append(f"{engine}: repeats disagree by " + ", ".join(f"{k} {v:.0%}" for k, v in wide.items()))
    return notes


class CompetingLoad:
    """`n` busy-looping child processes for the duration of a `with` block: a measurement under
    contention (another job sharing the cores), reproducible. Every child is killed and reaped on
    exit, whatever happened inside the block."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ConfigError(f"--competing-load: must be >= 0, got {n}")
        self.n = n
        self.procs: list = []

    def __enter__(self) -> CompetingLoad:
        import subprocess
        import sys

        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs = []
