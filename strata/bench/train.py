"""Training speed and memory: Strata's Trainer against the plain PyTorch loop, same invocation.

Every configuration (precision x activation checkpointing) runs in its own process
(python -m strata.bench.train_worker; see there for what each engine does), Strata and the peer
alternating, --repeats times over. Each process runs --warmup untimed steps, then --steps timed
ones, on the same random tokens and batch shapes. A row reports:

  tok/s       micro batch x seq len / step time: the median over every timed step of every
              repeat, and the spread (min-max) of the steps
  step ms     the median step time
  MFU         tok/s x training FLOPs per token (strata/train/flops.py: 6 x matmul parameters +
              causal attention) / the GEMM rate measured for the compute dtype (`strata hw`);
              model FLOPs: activation checkpointing's recomputation is not counted
  peak mem    the process's peak (CPU: ru_maxrss, GPU: the allocator's peak), median of the
              repeats; "train mem" is that minus the same figure just before the model was built
              (the interpreter, torch and transformers themselves left out)

then Strata / peer for each configuration, and the summary of each pair: activation
checkpointing X vs none (peak memory saved, step time paid) and bf16 vs fp32 step time. The
peer has no equivalent of "selective" or "attention" checkpointing: those rows have no peer.

examples:
  strata bench train                                         # smol-135m, seq 1024, batch 8
  strata bench train --model tiny --seq-len 128 --batch 4 --steps 5 --threads 1
  strata bench train --precision float32,bfloat16 --activation-checkpointing none,full --json train.json
  strata bench train --device cuda --precision bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.bench.common import ratio, write_json
from strata.bench.train_worker import PEER_ACTIVATION_CHECKPOINTING, resolve_with_placeholder
from strata.config import DTYPES
from strata.cpuinfo import cpu_model_and_flags
from strata.errors import ConfigError, StrataError
from strata.hardware.cores import default_threads
from strata.hardware.probe import probe
from strata.text_table import fmt_bytes, print_table
from strata.train.config import ACTIVATION_CHECKPOINTING, PRECISIONS
from strata.train.flops import train_flops_per_token
from strata.train.precision import resolve_precision

NAME = "train"
HELP = "training tokens/s, MFU and peak memory: Strata's Trainer vs a plain PyTorch/HF loop"
DESCRIPTION = __doc__
WORKER = "strata.bench.train_worker"
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class WorkerFailed(StrataError):
    """A configuration's worker process failed or ran past --timeout (it has been killed and reaped)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--model", default="smol-135m",
                   help="a named size (demo, tiny, smol-135m, qwen-0.5b), a config.json or an HF directory")
    g.add_argument("--seq-len", type=int, default=1024, help="tokens per training sequence")
    g.add_argument("--batch", type=int, default=8, help="micro batch: sequences per step (default 8)")
    g.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    g.add_argument("--repeats", type=int, default=1, help="runs of every configuration, alternating engines")
    g.add_argument("--precision", action="append", default=None, metavar="P[,P...]",
                   help=f"{' | '.join(PRECISIONS)}; repeatable or a comma list, one row each (default auto)")
    g.add_argument("--activation-checkpointing", action="append", default=None, metavar="MODE[,MODE...]",
                   help=f"{' | '.join(ACTIVATION_CHECKPOINTING)}; repeatable or a comma list (default none)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the token data")
    g.add_argument("--loss-chunk-tokens", type=int, default=0,
                   help="Strata's runs: LM head + loss over this many tokens at a time (default 0 = off)")
    g = p.add_argument_group("benchmark")
    g.add_argument("--peer", choices=("hf", "none"), default="hf",
                   help="hf: the plain PyTorch loop on transformers' model (default); none: Strata only")
    g.add_argument("--threads", type=int, default=None, help="torch threads of every run (default: physical cores)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--timeout", type=float, default=1800.0, help="bound on one run, seconds (default 1800)")
    g.add_argument("--json", default=None, metavar="FILE", help="write every figure to FILE as JSON")


# ------------------------------------------------------------------ flags


def parse_choices(values: list[str] | None, allowed: tuple[str, ...], flag: str, default: str) -> list[str]:
    """Repeated and comma-separated values, in order, without duplicates; each checked."""
    out: list[str] = []
    for raw in values or [default]:
        for v in (s.strip() for s in raw.split(",")):
            if v and v not in allowed:
                raise ConfigError(f"{flag} {v}: choose from {', '.join(allowed)}")
            if v and v not in out:
                out.append(v)
    if not out:
        raise ConfigError(f"{flag}: no value given")
    return out


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low in (("--seq-len", args.seq_len, 1), ("--batch", args.batch, 1),
                             ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                             ("--repeats", args.repeats, 1)):
        if value < low:
            raise ConfigError(f"{flag}: must be >= {low}, got {value}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads: must be >= 1, got {args.threads}")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {args.timeout}")


def resolve_precisions(asked: list[str], device: str) -> dict[str, str]:
    """Compute dtype name -> why ("auto" is decided once, here, so both engines get the same dtype)."""
    out: dict[str, str] = {}
    for name in asked:
        dtype, why = resolve_precision(name, device)
        out.setdefault(next(k for k, v in DTYPES.items() if v == dtype), f"{name}: {why}")
    return out


def peak_gflops(dtypes: list[str], device: str) -> dict[str, float]:
    """The measured GEMM rate per dtype (`strata hw`; cached); NaN where unknown, so MFU reads '-'."""
    try:
        profile = probe(device)
    except Exception as e:  # MFU is a report, never a reason to stop
        print(f"note: no hardware profile for MFU ({e})", file=sys.stderr)
        return {d: float("nan") for d in dtypes}
    return {d: profile.gemm_gflops.get(d) or profile.matmul_gflops.get(d) or float("nan") for d in dtypes}


def device_name(device: str) -> str:
    """The CPU model, and the GPU's name beside it on CUDA."""
    cpu = cpu_model_and_flags()[0]
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(device)} (host CPU {cpu})"
    return cpu


# ------------------------------------------------------------------ running one configuration


@dataclass(frozen=True)
class RunSpec:
    engine: str  # strata | hf
    precision: str  # a compute dtype name
    activation_checkpointing: str

    @property
    def label(self) -> str:
        return f"{self.engine} ({self.precision}, activation checkpointing {self.activation_checkpointing})"


def worker_argv(spec: RunSpec, args: argparse.Namespace, threads: int) -> list[str]:
    return ["--json", "--engine", spec.engine, "--model", args.model, "--seq-len", str(args.seq_len),
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--precision", spec.precision, "--activation-checkpointing", spec.activation_checkpointing,
            "--threads", str(threads), "--device", args.device, "--seed", str(args.seed),
            "--loss-chunk-tokens", str(getattr(args, "loss_chunk_tokens", 0) if spec.engine == "strata" else 0)]


def _kill_and_reap(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL the worker's process group if it still runs, then wait for it; (stdout, stderr) left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: nothing it started outlives it
        except (ProcessLookupError, PermissionError):
            proc.kill()
    return proc.communicate()


def _last_json_line(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _failure(label: str, rc: int, record: dict | None, stderr: str, argv: list[str]) -> WorkerFailed:
    if record is not None and "error" in record:
        return WorkerFailed(f"{label}: {record['error']}")
    if rc < 0:
        why = f"killed by signal {-rc}" + (" (out of memory? lower --batch or --seq-len)" if -rc == 9 else "")
    else:
        why = f"exited with code {rc} and no result"
    tail = "\n".join(stderr.strip().splitlines()[-10:])
    rerun = " ".join([sys.executable, "-m", WORKER, *argv])
    return WorkerFailed(f"{label}: the worker {why}; run it alone to see why: {rerun}\n{tail}".rstrip())


def run_worker(argv: list[str], label: str, timeout_s: float, threads: int) -> dict[str, Any]:
    """One worker process to its JSON line; killed and reaped whatever happens (error, timeout, Ctrl-C)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", WORKER, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    stdout = stderr = ""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_and_reap(proc)
        raise WorkerFailed(f"{label}: ran past --timeout {timeout_s:g} s and was killed; raise --timeout, "
                           "or lower --steps, --seq-len or --batch") from None
    finally:
        if proc.returncode is None:  # interrupted (Ctrl-C) or an error while waiting
            _kill_and_reap(proc)
    record = _last_json_line(stdout)
    if proc.returncode != 0 or record is None or "error" in record:
        raise _failure(label, proc.returncode, record, stderr, argv)
    return record


# ------------------------------------------------------------------ figures


@dataclass
class Row:
    spec: RunSpec
    runs: list[dict[str, Any]] = field(default_factory=list)

    def figures(self, flops_per_token: float, peak: float) -> dict[str, Any]:
        """Median and spread over every timed step of every run; memory: median of the runs."""
        tokens = self.runs[0]["tokens_per_step"]
        seconds = [s for r in self.runs for s in r["step_seconds"]]
        rates = [tokens / s for s in seconds]
        tok_s = statistics.median(rates)
        return {
            "engine": self.spec.engine, "precision": self.spec.precision,
            "activation_checkpointing": self.spec.activation_checkpointing,
            "tokens_per_step": tokens, "timed_steps": len(seconds),
            "tokens_per_s": tok_s, "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
            "step_s": statistics.median(seconds), "step_s_min": min(seconds), "step_s_max": max(seconds),
            "mfu": tok_s * flops_per_token / (peak * 1e9) if peak > 0 else float("nan"),
            "peak_memory_bytes": int(statistics.median(r["peak_memory_bytes"] for r in self.runs)),
            "train_memory_bytes": int(statistics.median(r["train_memory_bytes"] for r in self.runs)),
            "checkpointed_layers": self.runs[0]["checkpointed_layers"],
            "final_loss": self.runs[-1]["losses"][-1],
            "runs": self.runs,
        }


def pair_ratio(strata: dict, peer: dict) -> dict[str, Any]:
    """Strata / peer of one configuration (> 1: Strata is faster on tok/s, uses more on memory)."""
    return {
        "precision": strata["precision"], "activation_checkpointing": strata["activation_checkpointing"],
        **{k: ratio(strata[k], peer[k]) for k in ("tokens_per_s", "step_s", "mfu", "peak_memory_bytes",
                                                 "train_memory_bytes")},
    }


def peer_ratios(rows: list[dict]) -> list[dict[str, Any]]:
    """Strata / peer for every configuration both ran."""
    out = []
    for r in rows:
        peer = _find(rows, "hf", r["precision"], r["activation_checkpointing"]) if r["engine"] == "strata" else None
        if peer is not None:
            out.append(pair_ratio(r, peer))
    return out


def _find(rows: list[dict], engine: str, precision: str, ac: str) -> dict | None:
    return next((r for r in rows if (r["engine"], r["precision"], r["activation_checkpointing"])
                 == (engine, precision, ac)), None)


def _pct(new: float, old: float) -> float:
    return 100.0 * (new / old - 1.0) if old > 0 else float("nan")


def summaries(rows: list[dict]) -> list[dict[str, Any]]:
    """Activation checkpointing MODE vs none per (engine, precision), and each narrower dtype vs
    fp32 per (engine, mode): the comparisons a reader would otherwise do by hand."""
    out = []
    for r in rows:
        base = _find(rows, r["engine"], r["precision"], "none")
        if r["activation_checkpointing"] != "none" and base is not None:
            mem, train_mem = _pct(r["peak_memory_bytes"], base["peak_memory_bytes"]), \
                _pct(r["train_memory_bytes"], base["train_memory_bytes"])
            step = _pct(r["step_s"], base["step_s"])
            out.append({
                "kind": "activation_checkpointing", "engine": r["engine"], "precision": r["precision"],
                "mode": r["activation_checkpointing"], "peak_memory_change_pct": mem,
                "train_memory_change_pct": train_mem, "step_time_change_pct": step,
                "text": f"{r['engine']}, {r['precision']}: activation checkpointing {r['activation_checkpointing']} "
                        f"vs none: peak memory {mem:+.1f}% (memory added by training {train_mem:+.1f}%), "
                        f"step time {step:+.1f}%"})
    for r in rows:
        base = _find(rows, r["engine"], "float32", r["activation_checkpointing"])
        if r["precision"] != "float32" and base is not None:
            x = ratio(r["step_s"], base["step_s"])
            short = SHORT_DTYPE[r["precision"]]
            out.append({
                "kind": "precision", "engine": r["engine"], "precision": r["precision"],
                "mode": r["activation_checkpointing"], "step_time_ratio": x,
                "text": f"{r['engine']}, activation checkpointing {r['activation_checkpointing']}: {short} vs fp32 "
                        f"step time: {x:.2f}x"})
    return out


def _table_row(f: dict) -> list:
    return [f["engine"], f["precision"], f["activation_checkpointing"], f["tokens_per_s"],
            f"{f['tokens_per_s_min']:,.0f}-{f['tokens_per_s_max']:,.0f}", f["step_s"] * 1e3,
            f"{f['mfu']:.1%}" if f["mfu"] == f["mfu"] else "-", fmt_bytes(f["peak_memory_bytes"]),
            fmt_bytes(f["train_memory_bytes"])]


def _ratio_row(r: dict) -> list:
    def x(v: float) -> str:
        return f"{v:.2f}x" if v == v else "-"

    return ["strata/hf", "", "", x(r["tokens_per_s"]), "", x(r["step_s"]), x(r["mfu"]),
            x(r["peak_memory_bytes"]), x(r["train_memory_bytes"])]


def table_rows(rows: list[dict], ratios: list[dict]) -> list[list]:
    """Each configuration's rows: strata, its peer, then strata/hf."""
    by_config = {(r["precision"], r["activation_checkpointing"]): r for r in ratios}
    out = []
    for f in rows:
        out.append(_table_row(f))
        config = (f["precision"], f["activation_checkpointing"])
        if f["engine"] == "hf" and config in by_config:
            out.append(_ratio_row(by_config[config]))
    return out


# ------------------------------------------------------------------ the command


def plan_runs(dtypes: list[str], modes: list[str], peer: str) -> list[RunSpec]:
    """Every configuration, Strata then its peer, so the engines alternate over the machine's drift."""
    specs = []
    for dtype in dtypes:
        for mode in modes:
            specs.append(RunSpec("strata", dtype, mode))
            if peer == "hf" and mode in PEER_ACTIVATION_CHECKPOINTING:
                specs.append(RunSpec("hf", dtype, mode))
    return specs


def run(args: argparse.Namespace) -> int:
    import torch

    _check_numbers(args)
    precisions = parse_choices(args.precision, PRECISIONS, "--precision", "auto")
    modes = parse_choices(args.activation_checkpointing, ACTIVATION_CHECKPOINTING,
                          "--activation-checkpointing", "none")
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)  # the hardware profile's key includes the thread count
    with tempfile.TemporaryDirectory(prefix="strata-bench-train-") as tmp:
        model_config = resolve_with_placeholder(args.model, Path(tmp)).model_config  # a bad --model stops here
    if args.seq_len > model_config.max_position_embeddings:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings "
                          f"({model_config.max_position_embeddings}); lower --seq-len")
    dtypes = resolve_precisions(precisions, args.device)
    flops = train_flops_per_token(model_config, args.seq_len)
    peaks = peak_gflops(list(dtypes), args.device)
    specs = plan_runs(list(dtypes), modes, args.peer)
    print(f"model {args.model} ({model_config.architecture}, {model_config.num_params() / 1e6:.1f}M params), "
          f"seq {args.seq_len} x batch {args.batch}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeats} repeat(s), one process per run\n"
          f"{args.device}: {device_name(args.device)}, {threads} thread{'s' * (threads != 1)}; training FLOPs/token "
          f"{flops / 1e6:.1f} M; MFU against the measured GEMM rate "
          + ", ".join(f"{SHORT_DTYPE[d]} {peaks[d]:.0f} GFLOP/s" for d in dtypes))
    for dtype, why in dtypes.items():
        if why.startswith("auto"):
            print(f"--precision {why} -> {dtype}")
    rows = {spec: Row(spec) for spec in specs}
    for repeat in range(args.repeats):
        for spec in specs:
            print(f"  run {repeat + 1}/{args.repeats}: {spec.label}", file=sys.stderr, flush=True)
            rows[spec].runs.append(run_worker(worker_argv(spec, args, threads), spec.label, args.timeout, threads))
    figures = [row.figures(flops, peaks[spec.precision]) for spec, row in rows.items()]
    ratios = peer_ratios(figures)
    print()
    print_table(["engine", "precision", "act. ckpt", "tok/s", "tok/s min-max", "step ms", "MFU", "peak mem",
                 "train mem"], table_rows(figures, ratios))
    found = summaries(figures)
    for s in found:
        print(s["text"])
    write_json(args.json, {
        "benchmark": NAME, "model": args.model, "architecture": model_config.architecture,
        "params": model_config.num_params(), "device": args.device, "device_name": device_name(args.device),
        "cpu": cpu_model_and_flags()[0], "threads": threads, "seq_len": args.seq_len, "batch": args.batch,
        "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats, "seed": args.seed,
        "peer": args.peer, "precisions": dtypes, "activation_checkpointing": modes,
        "flops_per_token": flops, "peak_gflops": peaks, "rows": figures, "ratios": ratios, "summaries": found,
    })
    return 0
