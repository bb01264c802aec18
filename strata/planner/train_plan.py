"""`strata plan --train`: the memory one training rank needs, component by component, per
activation-checkpointing mode, against the device's memory; `--measure` runs `strata train` for 3
steps with the same settings and compares its logged peak.

The arithmetic is strata/train/memory_plan.py (predict_train_memory), which `strata train --check`
uses too. With --lora the base is frozen in its storage format (fp32, or --quantization int8 /
int4) and only the adapter has gradients and optimizer states. On CPU the measured figure is the process's peak RSS, so the prediction includes the
runtime baseline (a microscopic training step's RSS, measured in a subprocess) and glibc's heap
retention; on CUDA it is the caching allocator's peak, which excludes the CUDA context.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from strata.config import DTYPES
from strata.demo.model import demo_config
from strata.errors import ConfigError, StrataError
from strata.hardware.probe import probe
from strata.hardware.specs import lookup, parse_hardware
from strata.model_config import ModelConfig
from strata.planner.plan import resolve_model
from strata.text_table import fmt_bytes, print_table
from strata.train.config import ACTIVATION_CHECKPOINTING, LORA_TARGETS
from strata.train.memory_plan import LoRAPlan, TrainMemory, predict_train_memory
from strata.train.precision import resolve_precision

MEASURE_STEPS = 3


@dataclass(frozen=True)
class TrainPlanRequest:
    model: str
    seq_len: int
    micro_batch_size: int
    precision: str = "auto"
    activation_checkpointing: str = "none"
    ac_every: int = 2
    world_size: int | None = None  # None: the --hardware count (1 for `this`)
    distributed: str = "ddp"
    device: str = "cpu"
    hardware: str = "this"
    ddp_bucket_mb: float = 25.0
    loss_chunk_tokens: int = 0
    fused_loss: bool = True
    lora: bool = False
    lora_rank: int = 16
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    lora_dropout: float = 0.0
    quantization: str | None = None  # --lora: the frozen base's projections (int8, int4)
    quantization_group_size: int = 64

    def lora_plan(self) -> LoRAPlan | None:
        if self.quantization is not None and not self.lora:
            raise ConfigError(f"--train --quantization {self.quantization}: a quantized base trains only with "
                              "--lora (the adapter on the frozen base); add --lora")
        if not self.lora:
            return None
        if self.quantization not in (None, "int8", "int4"):
            raise ConfigError(f"--train --lora --quantization {self.quantization}: a LoRA base is held in fp32, "
                              "int8 or int4")
        return LoRAPlan(self.lora_rank, tuple(self.lora_target_modules), self.lora_dropout, self.quantization,
                        self.quantization_group_size)


@dataclass
class TrainPlan:
    request: TrainPlanRequest
    memory: TrainMemory
    by_mode: dict[str, TrainMemory]  # the same run under every checkpointing mode
    precision_reason: str
    device_name: str
    device_memory: int | None  # per rank
    measured_peak: int | None = None

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.memory.peak_bytes <= self.device_memory

    @property
    def measured_error(self) -> float | None:
        """(predicted - measured) / measured, both as `strata train` reports the peak."""
        if not self.measured_peak:
            return None
        return (self.memory.measurable_peak - self.measured_peak) / self.measured_peak

    def to_json(self) -> dict:
        return {
            "request": {**self.request.__dict__, "lora_target_modules": list(self.request.lora_target_modules)},
            "precision_reason": self.precision_reason,
            "device": self.device_name, "device_memory_bytes": self.device_memory, "fits": self.fits,
            "memory": self.memory.to_json(),
            "by_mode": {m: {"activations": t.saved.activations, "peak_bytes": t.peak_bytes}
                        for m, t in self.by_mode.items()},
            "measured_peak_bytes": self.measured_peak, "measured_error": self.measured_error,
        }


# ---------------------------------------------------------------- inputs


def resolve_train_model(spec: str) -> ModelConfig:
    """--model as `strata train` takes it: demo, a random shape, a config.json or an HF directory."""
    if spec == "demo":
        return ModelConfig.from_dict({**demo_config(), "torch_dtype": "float32"}, "demo")
    return resolve_model(spec)[0]


def _target(req: TrainPlanRequest) -> tuple[str, str, int | None, int]:
    """(device type, device name, memory per device, device count) of --hardware."""
    name, count = parse_hardware(req.hardware)
    if name.lower() == "this":
        p = probe(req.device)
        return torch.device(req.device).type, f"this ({p.device})", p.memory_bytes, 1
    spec = lookup(name)
    return "cuda", spec.name, spec.memory_bytes, count


def _precision(req: TrainPlanRequest) -> tuple[torch.dtype, str]:
    if req.precision != "auto":
        return DTYPES[req.precision], "as asked (--precision)"
    if req.hardware.lower() == "this":
        return resolve_precision("auto", req.device)
    spec = lookup(parse_hardware(req.hardware)[0])
    if "bf16" in spec.tflops:  # as strata train's auto on CUDA: bf16 where the device has it
        return torch.bfloat16, f"{spec.name} has bf16"
    return torch.float16, f"{spec.name} has no bf16: fp16 with loss scaling"


def build_train_plan(req: TrainPlanRequest, runtime_baseline_bytes: int | None = None) -> TrainPlan:
    if req.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(f"--activation-checkpointing {req.activation_checkpointing!r}; choose one of "
                          f"{', '.join(ACTIVATION_CHECKPOINTING)}")
    cfg = resolve_train_model(req.model)
    if req.seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"--seq-len {req.seq_len} exceeds the model's max_position_embeddings "
                          f"({cfg.max_position_embeddings}); use --seq-len {cfg.max_position_embeddings} or less")
    device_type, device_name, memory, count = _target(req)
    dtype, reason = _precision(req)
    world = req.world_size or count
    lora = req.lora_plan()

    def predict(mode: str) -> TrainMemory:
        return predict_train_memory(
            cfg, seq_len=req.seq_len, micro_batch_size=req.micro_batch_size, compute_dtype=dtype,
            activation_checkpointing=mode, ac_every=req.ac_every, world_size=world,
            distributed=req.distributed, device_type=device_type, ddp_bucket_mb=req.ddp_bucket_mb,
            data_tokens=0, runtime_baseline_bytes=runtime_baseline_bytes, model_name=req.model,
            loss_chunk_tokens=req.loss_chunk_tokens, fused_loss=req.fused_loss, lora=lora)

    by_mode = {m: predict(m) for m in ACTIVATION_CHECKPOINTING}
    return TrainPlan(req, by_mode[req.activation_checkpointing], by_mode, reason, device_name, memory)


# ---------------------------------------------------------------- --measure


def _write_word_tokenizer(out: Path, words: int) -> None:
    """A word-level tokenizer over w0 .. w{words-1}: one token per word, so the data's token count
    is known, and small enough for any model's vocabulary."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(out / "tokenizer.json"))


def _write_random_text(path: Path, words: int, vocab_words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    lines = (" ".join(f"w{rng.randrange(vocab_words)}" for _ in range(min(64, words - i)))
             for i in range(0, words, 64))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def train_command(req: TrainPlanRequest, tmp: Path, world: int, threads: int | None) -> list[str]:
    """The `strata train` run --measure makes: the plan's settings, 3 steps, random data."""
    cmd = [sys.executable, "-m", "strata", "train", "--model", req.model, "--tokenizer", str(tmp),
           "--data", str(tmp / "data.txt"), "--seq-len", str(req.seq_len),
           "--micro-batch-size", str(req.micro_batch_size), "--precision", req.precision,
           "--activation-checkpointing", req.activation_checkpointing, "--ac-every", str(req.ac_every),
           "--max-steps", str(MEASURE_STEPS), "--warmup-steps", "1", "--log-every", "1",
           "--save-every", "0", "--no-tensorboard", "--no-resume", "--num-workers", "0",
           "--out-dir", str(tmp / "out"), "--device", req.device, "--distributed", req.distributed,
           "--ddp-bucket-mb", str(req.ddp_bucket_mb), "--loss-chunk-tokens", str(req.loss_chunk_tokens),
           "--fused-loss" if req.fused_loss else "--no-fused-loss"]
    if req.lora:
        cmd += ["--lora", "--lora-rank", str(req.lora_rank), "--lora-dropout", str(req.lora_dropout),
                "--lora-target-modules", *req.lora_target_modules]
        if req.quantization:
            cmd += ["--quantization", req.quantization, "--quantization-group-size", str(req.quantization_group_size)]
    if world > 1:
        cmd += ["--nproc-per-node", str(world)]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


def measure_train_peak(req: TrainPlanRequest, world: int = 1, threads: int | None = None,
                       timeout_s: float = 3600) -> tuple[int, int]:
    """(peak_memory_bytes rank 0 logged at its last step, tokens in the data) of a 3-step
    `strata train` run in a subprocess, on random text."""
    vocab_words = 200
    tokens_needed = MEASURE_STEPS * req.micro_batch_size * world * (req.seq_len + 1) + req.seq_len + 2
    with tempfile.TemporaryDirectory(prefix="strata-plan-measure-") as d:
        tmp = Path(d)
        _write_word_tokenizer(tmp, vocab_words)
        _write_random_text(tmp / "data.txt", tokens_needed, vocab_words)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            run = subprocess.run(train_command(req, tmp, world, threads), capture_output=True, text=True,
                                 timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            raise StrataError(f"--measure: strata train did not finish in {timeout_s:.0f} s; measure a "
                              "smaller --seq-len / --micro-batch-size") from None
        if run.returncode != 0:
            tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-8:])
            raise StrataError(f"--measure: strata train exited with {run.returncode}:\n{tail}")
        peak = _last_peak(tmp / "out" / "metrics.jsonl")
    return peak, tokens_needed + 2  # + BOS and EOS around the one document


def _last_peak(metrics: Path) -> int:
    peaks = [json.loads(line).get("peak_memory_bytes") for line in metrics.read_text().splitlines() if line]
    peaks = [p for p in peaks if p]
    if not peaks:
        raise StrataError(f"--measure: {metrics} has no peak_memory_bytes line")
    return int(peaks[-1])


def measure(plan: TrainPlan, threads: int | None = None) -> TrainPlan:
    """Run the plan for real and re-predict with the run's data size (its token stream counts)."""
    req = plan.request
    peak, data_tokens = measure_train_peak(req, plan.memory.world_size, threads)
    m = plan.memory
    plan.memory = predict_train_memory(
        resolve_train_model(req.model), seq_len=req.seq_len, micro_batch_size=req.micro_batch_size,
        compute_dtype=DTYPES[m.dtype], activation_checkpointing=m.activation_checkpointing,
        ac_every=m.ac_every, world_size=m.world_size, distributed=m.distributed, device_type=m.device_type,
        ddp_bucket_mb=req.ddp_bucket_mb, data_tokens=data_tokens,
        runtime_baseline_bytes=m.components["runtime baseline"], model_name=req.model,
        loss_chunk_tokens=req.loss_chunk_tokens, fused_loss=req.fused_loss, lora=req.lora_plan())
    plan.measured_peak = peak
    return plan


# ---------------------------------------------------------------- the report


def format_train_plan(plan: TrainPlan) -> str:
    m, req = plan.memory, plan.request
    out = io.StringIO()
    tokens = req.seq_len * req.micro_batch_size
    dist = f"{m.world_size} ranks ({m.distributed})" if m.world_size > 1 else "1 rank"
    ac = m.activation_checkpointing + (f" (every {m.ac_every})" if m.activation_checkpointing == "selective" else "")
    print(f"strata plan --train: {req.model} ({m.params / 1e6:,.1f}M params) on {plan.device_name}, {dist}", file=out)
    print(f"  seq {req.seq_len} x micro-batch {req.micro_batch_size} = {tokens:,} tokens per rank per "
          f"micro-batch; {m.dtype}: {plan.precision_reason}; activation checkpointing {ac}", file=out)
    if m.lora is not None:
        base = m.lora["quantization"] or "fp32"
        print(f"  LoRA rank {m.lora['rank']} on {' '.join(m.lora['target_modules'])}: "
              f"{m.trainable_params / 1e6:,.3f}M trainable parameters; the base frozen in {base} (no gradients "
              "or optimizer states)", file=out)
    print(file=out)
    rows = [[name, fmt_bytes(size), fmt_bytes(m.at_peak[name]) if m.at_peak.get(name) else "-"]
            for name, size in m.components.items() if size]
    rows.append([f"predicted peak ({m.peak_phase})", "", fmt_bytes(m.peak_bytes)])
    print_table(["component (per rank)", "largest", "live at peak"], rows, file=out)
    if not m.baseline_in_measured_peak:
        print(f"  the CUDA allocator's peak (what strata train logs) excludes the runtime baseline: "
              f"{fmt_bytes(m.measurable_peak)}", file=out)
    if plan.device_memory is not None:
        verdict = "fits" if plan.fits else "does NOT fit: use --activation-checkpointing full or a smaller " \
                                           "--micro-batch-size"
        print(f"  device memory {fmt_bytes(plan.device_memory)}: {verdict} "
              f"({100 * m.peak_bytes / plan.device_memory:.0f}%)", file=out)
    print(file=out)
    mode_rows = []
    for mode, t in plan.by_mode.items():
        label = mode + (f" (every {t.ac_every})" if mode == "selective" else "")
        mode_rows.append([label, fmt_bytes(t.saved.activations), fmt_bytes(t.peak_bytes), t.peak_phase])
    print_table(["checkpointing", "activations saved", "predicted peak", "peak during"], mode_rows, file=out)
    if plan.measured_peak is not None:
        err = plan.measured_error or 0.0
        print(f"\nmeasured ({MEASURE_STEPS}-step strata train): peak {fmt_bytes(plan.measured_peak)}; predicted "
              f"{fmt_bytes(m.measurable_peak)}; error {100 * err:+.1f}%", file=out)
    return out.getvalue().rstrip("\n")
