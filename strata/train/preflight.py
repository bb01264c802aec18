"""`strata train --check`: the training-stability checklist as a preflight that trains nothing.

One line per check, `PASS name: detail`, `WARN name: detail. Fix: ...` (advice) or
`FAIL name: detail. Fix: ...`; the exit code is 1 when anything FAILs, else 0.

  gradient clipping   --grad-clip > 0
  precision           the autocast dtype runs on this device (a small autocast matmul + backward);
                      what `auto` picks and why
  loss scaling        fp16 needs GradScaler's dynamic loss scaling; bf16 and fp32 do not
  lr schedule         sampled over the run: every lr > 0, warmup rising, decaying to the end
  data loader         MEASURED: tokenization, one micro-batch fetch vs one forward + backward of
                      the model at (micro-batch, seq-len); the fetch runs inline in the training
                      loop, so above 10% of the step it is the bottleneck
  data epochs         tokens the run consumes vs the tokens the data holds
  tf32                on NVIDIA, whether fp32 matmuls use TF32
  sequence length     --seq-len <= the model's max_position_embeddings
  memory              the predicted peak per rank (strata.train.memory_plan, what `strata plan
                      --train` prints) vs the device's memory

A bad --model or --data path is a ConfigError, as for `strata train` itself.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from strata.comm.world import World
from strata.errors import ConfigError
from strata.graph.lora import LoRABatch, lora_batch
from strata.hardware.probe import probe
from strata.kernels.dispatch import reference_kernels
from strata.model_config import ModelConfig
from strata.text_table import fmt_bytes
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import TrainConfig
from strata.train.data import PackedWindows, batch_for, data_files, tokenize
from strata.train.flops import train_flops_per_token
from strata.train.lora import LoRASpec, attach_trainable, make_quantized_trainable
from strata.train.memory_plan import LoRAPlan, TrainMemory, predict_train_memory
from strata.train.model_init import ModelSource, build_model, load_tokenizer, resolve
from strata.train.optim import lr_at
from strata.train.precision import Precision, resolve_precision
from strata.train.trainer import LanguageModelLoss

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
FETCH_SHARE_LIMIT = 0.10  # a batch fetch above this share of the step's compute is a bottleneck
MAX_EPOCHS = 20  # more passes over the same data than this: memorisation, not learning
MEMORY_WARN_SHARE = 0.90
# the step-timing check runs at most this many FLOPs (a smaller batch, scaled, beyond it)
STEP_TIMING_FLOPS = 2e11  # ~1-2 s on one CPU core: FLOP-bound, so scaling by tokens holds
LR_SAMPLES = 2000


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # PASS | WARN | FAIL
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f". Fix: {self.fix}" if self.fix and self.status != PASS else ""
        return f"{self.status} {self.name}: {self.detail}{fix}"


# ---------------------------------------------------------------- configuration checks


def check_grad_clip(cfg: TrainConfig) -> CheckResult:
    if cfg.grad_clip > 0:
        return CheckResult("gradient clipping", PASS, f"global norm clipped to {cfg.grad_clip:g}")
    return CheckResult("gradient clipping", FAIL, "off (--grad-clip 0): one bad batch can blow up the weights",
                       "--grad-clip 1.0")


def _autocast_runs(dtype: torch.dtype, device: str) -> str | None:
    """None when a small autocast matmul and its backward run in `dtype` here, else the error."""
    try:
        x = torch.randn(16, 16, device=device, requires_grad=True)
        with torch.autocast(torch.device(device).type, dtype=dtype):
            y = x @ x
        if y.dtype != dtype:
            return f"autocast produced {y.dtype}, not {dtype}"
        y.float().sum().backward()
    except (RuntimeError, TypeError) as e:
        return str(e).splitlines()[0]
    return None


def check_precision(cfg: TrainConfig) -> tuple[CheckResult, torch.dtype]:
    """The result and the dtype the rest of the checks use (fp32 when the asked one fails)."""
    try:
        dtype, reason = resolve_precision(cfg.precision, cfg.device)
    except ConfigError as e:
        return CheckResult("precision", FAIL, str(e), "--precision float32 (or float16 on CUDA)"), torch.float32
    name = str(dtype).removeprefix("torch.")
    picked = f"auto -> {name}: {reason}" if cfg.precision == "auto" else f"{name}, {reason}"
    if dtype == torch.float32:
        return CheckResult("precision", PASS, f"{picked}; no autocast"), dtype
    error = _autocast_runs(dtype, cfg.device)
    if error is not None:
        return CheckResult("precision", FAIL, f"{picked}, but autocast {name} fails on {cfg.device}: {error}",
                           "--precision float32"), torch.float32
    return CheckResult("precision", PASS, f"{picked}; an autocast {name} matmul + backward ran on {cfg.device}"), dtype


def check_loss_scaling(cfg: TrainConfig, dtype: torch.dtype) -> CheckResult:
    if dtype != torch.float16:
        return CheckResult("loss scaling", PASS, f"not needed for {str(dtype).removeprefix('torch.')} "
                                                 "(fp32 exponent range)")
    if Precision(dtype, cfg.device).scaler.is_enabled():
        return CheckResult("loss scaling", PASS, "fp16 with GradScaler's dynamic loss scaling (backoff and a "
                                                 "skipped step on inf/NaN)")
    return CheckResult("loss scaling", FAIL, "fp16 without loss scaling: small gradients underflow to zero",
                       "--precision bfloat16 or float32")


def lr_samples(cfg: TrainConfig) -> list[tuple[int, float]]:
    """(step, lr) over the run: every warmup step, the last step, and an even spread between."""
    stride = max(1, cfg.max_steps // LR_SAMPLES)
    steps = sorted({*range(min(cfg.warmup_steps + 1, cfg.max_steps)), *range(0, cfg.max_steps, stride),
                    cfg.max_steps - 1})
    return [(s, lr_at(s, cfg)) for s in steps]


def check_lr_schedule(cfg: TrainConfig) -> CheckResult:
    name = "lr schedule"
    samples = lr_samples(cfg)
    bad = [(s, lr) for s, lr in samples if not lr > 0]
    if bad:
        return CheckResult(name, FAIL, f"lr {bad[0][1]:g} at step {bad[0][0]}: the update is zero there",
                           "--lr > 0 and --min-lr-ratio > 0")
    warm = [lr for s, lr in samples if s < cfg.warmup_steps]
    if any(b <= a for a, b in zip(warm, warm[1:])):
        return CheckResult(name, FAIL, "warmup does not rise step by step", "check --warmup-steps")
    peak, final = max(lr for _, lr in samples), samples[-1][1]
    shape = (f"warmup {cfg.warmup_steps} steps to {peak:.3g}, cosine to {final:.3g} at step {cfg.max_steps}"
             if cfg.warmup_steps else f"cosine from {peak:.3g} to {final:.3g} at step {cfg.max_steps}")
    if cfg.min_lr_ratio == 1:
        return CheckResult(name, WARN, f"constant lr {peak:.3g} after warmup (--min-lr-ratio 1)",
                           "--min-lr-ratio 0.1 (decay usually lowers the final loss)")
    if not final < peak:
        return CheckResult(name, FAIL, f"{shape}: the lr never decays", "--min-lr-ratio below 1")
    if cfg.warmup_steps == 0:
        return CheckResult(name, WARN, f"{shape}, no warmup: full lr on the first, noisiest steps",
                           "--warmup-steps of ~1-5% of --max-steps")
    return CheckResult(name, PASS, shape)


def check_tf32(cfg: TrainConfig, dtype: torch.dtype) -> CheckResult:
    if not cfg.device.startswith("cuda"):
        return CheckResult("tf32", PASS, "n/a (no CUDA)")
    allow = bool(torch.backends.cuda.matmul.allow_tf32)
    setting = (f"torch.backends.cuda.matmul.allow_tf32={allow}, "
               f"float32_matmul_precision={torch.get_float32_matmul_precision()}")
    if dtype != torch.float32:
        return CheckResult("tf32", PASS, f"matmuls run in {str(dtype).removeprefix('torch.')} under autocast; {setting}")
    if allow:
        return CheckResult("tf32", PASS, f"fp32 matmuls use TF32 tensor cores; {setting}")
    return CheckResult("tf32", WARN, f"fp32 matmuls run in full fp32, several times slower than TF32; {setting}",
                       "--precision bfloat16, or TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 for TF32 matmuls")


def check_seq_len(cfg: TrainConfig, model: ModelConfig) -> CheckResult:
    limit = model.max_position_embeddings
    if cfg.seq_len <= limit:
        return CheckResult("sequence length", PASS, f"--seq-len {cfg.seq_len} <= max_position_embeddings {limit}")
    return CheckResult("sequence length", FAIL, f"--seq-len {cfg.seq_len} > the model's max_position_embeddings "
                                                f"{limit}", f"--seq-len {limit}")


# ---------------------------------------------------------------- memory


def world_size(cfg: TrainConfig) -> int:
    world = World.from_env()
    return world.world_size if world is not None else cfg.nproc_per_node


def _predict(cfg: TrainConfig, model: ModelConfig, dtype: torch.dtype, data_tokens: int,
             baseline: int | None, *, mode: str | None = None, micro_batch: int | None = None,
             seq_len: int | None = None) -> TrainMemory:
    return predict_train_memory(
        model, seq_len=seq_len or cfg.seq_len, micro_batch_size=micro_batch or cfg.micro_batch_size, compute_dtype=dtype,
        activation_checkpointing=mode or cfg.activation_checkpointing, ac_every=cfg.ac_every,
        world_size=world_size(cfg), distributed=cfg.distributed, device_type=torch.device(cfg.device).type,
        ddp_bucket_mb=cfg.ddp_bucket_mb, data_tokens=data_tokens, runtime_baseline_bytes=baseline,
        loss_chunk_tokens=cfg.loss_chunk_tokens, fused_loss=cfg.fused_loss, lora=LoRAPlan.of(cfg))


def _memory_fix(cfg: TrainConfig, model: ModelConfig, dtype: torch.dtype, data_tokens: int, baseline: int | None,
                capacity: int) -> str:
    """The cheapest change that fits with headroom: full checkpointing, then the largest micro-batch
    under it."""
    options = []
    if cfg.activation_checkpointing != "full":
        full = _predict(cfg, model, dtype, data_tokens, baseline, mode="full")
        if full.peak_bytes <= MEMORY_WARN_SHARE * capacity:
            return f"--activation-checkpointing full (predicted {fmt_bytes(full.peak_bytes)})"
        options.append("--activation-checkpointing full")
    for b in range(cfg.micro_batch_size - 1, 0, -1):
        m = _predict(cfg, model, dtype, data_tokens, baseline, mode="full", micro_batch=b)
        if m.peak_bytes <= MEMORY_WARN_SHARE * capacity:
            return " and ".join([*options, f"--micro-batch-size {b} (raise --grad-accum to keep the batch; "
                                 f"predicted {fmt_bytes(m.peak_bytes)})"])
    return ("--activation-checkpointing full / smaller --micro-batch-size do not suffice: shorter --seq-len, "
            "--distributed fsdp over more ranks, or a smaller model")


def check_memory(cfg: TrainConfig, model: ModelConfig, dtype: torch.dtype, data_tokens: int,
                 capacity: int, baseline: int | None = None) -> CheckResult:
    m = _predict(cfg, model, dtype, data_tokens, baseline)
    share = m.peak_bytes / capacity
    detail = (f"predicted peak {fmt_bytes(m.peak_bytes)} per rank ({m.peak_phase}) of {fmt_bytes(capacity)} "
              f"({100 * share:.0f}%); strata plan --train shows the parts")
    if share > 1:
        return CheckResult("memory", FAIL, detail, _memory_fix(cfg, model, dtype, data_tokens, baseline, capacity))
    if share > MEMORY_WARN_SHARE:
        return CheckResult("memory", WARN, detail + ": little headroom",
                           "--activation-checkpointing full / smaller --micro-batch-size")
    return CheckResult("memory", PASS, detail)


def device_memory(device: str) -> int:
    return probe(device).memory_bytes


# ---------------------------------------------------------------- data (measured)


@dataclass(frozen=True)
class DataTiming:
    tokens: int  # tokens the packed windows hold
    tokenize_s: float
    fetch_s: float  # one micro-batch via PackedWindows.samples (median)
    step_s: float | None  # one forward + backward at (micro_batch_size, seq_len); None: not timed
    step_note: str  # how the step was timed, or why not


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:,.3g} s"


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_fetch(data: PackedWindows, cfg: TrainConfig) -> float:
    def fetch(step: int) -> Callable[[], object]:
        first = batch_for(step, 0, 0, micro_batch=cfg.micro_batch_size, grad_accum=cfg.grad_accum,
                          world_size=world_size(cfg))
        return lambda: data.samples(first, cfg.micro_batch_size)

    fetch(0)()  # the epoch's permutation is drawn once per epoch
    return statistics.median(_seconds(fetch(s), 1) for s in range(1, 8))


def step_timing_shape(cfg: TrainConfig, model: ModelConfig) -> tuple[int, int]:
    """(micro-batch, seq-len) to time, capped at STEP_TIMING_FLOPS; the result scales by tokens."""
    per_token = train_flops_per_token(model, cfg.seq_len)
    budget_tokens = max(16, int(STEP_TIMING_FLOPS / per_token))
    if cfg.micro_batch_size * cfg.seq_len <= budget_tokens:
        return cfg.micro_batch_size, cfg.seq_len
    if cfg.seq_len <= budget_tokens:
        return budget_tokens // cfg.seq_len, cfg.seq_len
    return 1, min(cfg.seq_len, budget_tokens)


def time_step(cfg: TrainConfig, src: ModelSource, dtype: torch.dtype) -> tuple[float, str]:
    """Seconds of one forward + backward of the model at (micro_batch_size, seq_len), as the
    trainer runs it (autocast, activation checkpointing, the torch reference kernels)."""
    model_cfg = src.model_config
    batch, length = step_timing_shape(cfg, model_cfg)
    lm = build_model(src, cfg.seed, None, frozen=cfg.lora, quantization=cfg.quantization,
                     group_size=cfg.quantization_group_size).to(cfg.device)
    adapters = None
    if cfg.lora:  # as the trainer: the frozen base, one trainable slot, every forward through it
        make_quantized_trainable(lm)
        attach_trainable(lm, LoRASpec.of(cfg), cfg.seed, cfg.model)
        adapters = LoRABatch.every_row(0)
    apply_activation_checkpointing(lm, cfg.activation_checkpointing, cfg.ac_every)
    module, precision = LanguageModelLoss(lm), Precision(dtype, cfg.device)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, length + 1), device=cfg.device)

    def step() -> None:
        with lora_batch(adapters), precision.autocast():
            loss = module(ids[:, :-1], ids[:, 1:])
            loss.backward()
        if cfg.device.startswith("cuda"):
            torch.cuda.synchronize()

    with reference_kernels():
        step()  # the first step pays one-off costs (allocation, kernel selection)
        seconds = _seconds(step, 1)
    scale = cfg.micro_batch_size * cfg.seq_len / (batch * length)
    if scale == 1:
        return seconds, f"forward + backward at {batch} x {length}"
    return seconds * scale, (f"forward + backward timed at {batch} x {length} and scaled x{scale:.3g} to "
                             f"{cfg.micro_batch_size} x {cfg.seq_len} (keeps the check's cost small)")


def measure_data(cfg: TrainConfig, src: ModelSource, dtype: torch.dtype, files: list[Path],
                 time_the_step: bool = True) -> DataTiming:
    tok = load_tokenizer(src.tokenizer_dir)
    mc = src.model_config
    eos = mc.eos_token_ids[0] if mc.eos_token_ids else (tok.token_to_id("<|end_of_text|>") or 0)
    start = time.perf_counter()
    stream = tokenize(files, tok, mc.bos_token_id, eos, cfg.num_workers)
    tokenize_s = time.perf_counter() - start
    data = PackedWindows(stream, cfg.seq_len, cfg.seed)  # ConfigError when no window fits
    fetch_s = time_fetch(data, cfg)
    if not time_the_step:
        return DataTiming(data.tokens, tokenize_s, fetch_s, None, "the model does not fit this device's memory")
    step_s, note = time_step(cfg, src, dtype)
    return DataTiming(data.tokens, tokenize_s, fetch_s, step_s, note)


def check_data_loader(t: DataTiming, cfg: TrainConfig) -> CheckResult:
    fetch = (f"fetching a micro-batch of {cfg.micro_batch_size} x {cfg.seq_len} takes {_duration(t.fetch_s)}; "
             f"tokenizing took {t.tokenize_s:.2f} s with {cfg.num_workers} worker(s)")
    if t.step_s is None:
        return CheckResult("data loader", WARN, f"{fetch}; the step was not timed ({t.step_note})",
                           "fix the memory check first")
    share = t.fetch_s / t.step_s if t.step_s > 0 else math.inf
    detail = f"{fetch}; that is {100 * share:.2g}% of the {_duration(t.step_s)} {t.step_note}"
    if share > FETCH_SHARE_LIMIT:
        return CheckResult("data loader", FAIL, f"{detail}: over {100 * FETCH_SHARE_LIMIT:.0f}%, the data is the "
                                                "bottleneck", "a larger --micro-batch-size or --seq-len per fetch, or "
                                                "faster storage for the token stream")
    return CheckResult("data loader", PASS, detail)


def check_data_epochs(cfg: TrainConfig, available_tokens: int) -> CheckResult:
    consumed = cfg.max_steps * cfg.grad_accum * cfg.micro_batch_size * world_size(cfg) * cfg.seq_len
    epochs = consumed / max(1, available_tokens)
    detail = f"the run reads {consumed:,} tokens of the {available_tokens:,} in the data: {epochs:.3g} epochs"
    if epochs > MAX_EPOCHS:
        return CheckResult("data epochs", WARN, detail + f", over {MAX_EPOCHS}: the model will memorise it",
                           f"more --data, or --max-steps {int(cfg.max_steps * MAX_EPOCHS / epochs)} or fewer")
    return CheckResult("data epochs", PASS, detail)


# ---------------------------------------------------------------- the checklist


def preflight(cfg: TrainConfig, *, capacity: int | None = None,
              runtime_baseline_bytes: int | None = None) -> list[CheckResult]:
    """Every check's result. `capacity`: device memory (default: the hardware profile's);
    `runtime_baseline_bytes`: the memory plan's baseline (default: measured once)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    src = resolve(cfg.model, cfg.tokenizer, lora=cfg.lora)  # ConfigError names a bad --model / --tokenizer
    files = data_files(cfg.data)  # ... and a bad --data path
    model = src.model_config
    capacity = capacity if capacity is not None else device_memory(cfg.device)
    results = [check_grad_clip(cfg)]
    precision, dtype = check_precision(cfg)
    results += [precision, check_loss_scaling(cfg, dtype), check_lr_schedule(cfg)]
    seq = check_seq_len(cfg, model)
    tokens = 0
    if seq.status == FAIL:  # the model cannot run at this length: nothing to time
        results.append(CheckResult("data loader", WARN, "not measured: --seq-len exceeds the model's positions",
                                   seq.fix))
    else:
        batch, length = step_timing_shape(cfg, model)
        timing_run = _predict(cfg, model, dtype, 0, runtime_baseline_bytes, micro_batch=batch, seq_len=length)
        timing = measure_data(cfg, src, dtype, files, time_the_step=timing_run.peak_bytes <= capacity)
        results += [check_data_loader(timing, cfg), check_data_epochs(cfg, timing.tokens)]
        tokens = timing.tokens
    results += [check_tf32(cfg, dtype), seq]
    results.append(check_memory(cfg, model, dtype, tokens, capacity, runtime_baseline_bytes))
    return results


def run_checks(cfg: TrainConfig) -> int:
    """Print the checklist, one line per check; 1 when anything FAILs, else 0."""
    results = preflight(cfg)
    for r in results:
        print(r.line(), flush=True)
    return 1 if any(r.status == FAIL for r in results) else 0
