"""The training loop: schedule -> micro-batches (autocast forward, scaled backward) -> unscale, clip,
guard -> step -> log -> checkpoint. Every rank runs this same loop; rank 0 writes.

The model is the engine's CausalLM running its plain causal forward under autograd (no paged-KV
metadata); activation checkpointing and data parallelism are applied from outside it. With --lora
(lora.py) the model is a frozen base carrying one trainable adapter slot, every forward and
backward runs inside its LoRA batch, and checkpoints and the export hold the adapter alone.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from strata.errors import StrataError
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.models.llama import CausalLM
from strata.hardware.probe import probe
from strata.kernels.dispatch import reference_kernels
from strata.train import checkpoint as ckpt
from strata.train import distributed
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import TrainConfig
from strata.train.data import PackedWindows, batch_for, data_files, tokenize
from strata.train.export import export_hf
from strata.train.flops import train_flops_per_token
from strata.train.fused_loss import fused_cross_entropy, fused_loss_applies
from strata.train.lora import (
    ADAPTER_FILE,
    LoRASpec,
    adapter_state,
    attach_trainable,
    base_record,
    head_weight,
    load_adapter_state,
    make_quantized_trainable,
    write_peft_adapter,
)
from strata.train.metrics import MetricsSink, SpikeDetector, peak_memory_bytes
from strata.train.model_init import build_model, load_tokenizer, resolve
from strata.train.moe_loss import (
    RouterLosses,
    RouterStats,
    imbalance,
    plot_histogram,
    router_losses,
)
from strata.train.optim import lr_at, make_optimizer, set_lr
from strata.train.precision import Precision, resolve_precision

logger = logging.getLogger(__name__)


class TrainingError(StrataError, RuntimeError):
    """Training cannot go on (too many non-finite steps in a row, ...)."""


class LanguageModelLoss(nn.Module):
    """CausalLM + next-token cross-entropy in one forward (what DDP and FSDP wrap).

    With `chunk_tokens`, the LM head and the loss run over that many tokens at a time, each chunk
    under activation checkpointing: the [tokens, vocab] logits (and their fp32 copy, log-softmax
    and gradient) exist for one chunk at a time instead of the whole batch, for one more LM-head
    matmul in backward. Equal to the unchunked loss up to float summation order.

    Else with `fused` (the default), the LM head and the loss run fused by chunks with their
    gradients computed in the forward (fused_loss.py: no whole logits either, nothing recomputed)
    while grad mode is on and the head is a plain linear one (no logit soft-capping).

    With `router` (an MoE model) and in train mode, the MoE terms are added (moe_loss.py) and
    `router_stats` holds the last forward's, for the log; eval mode returns the LM loss alone."""

    def __init__(self, lm: CausalLM, chunk_tokens: int = 0, fused: bool = False,
                 router: RouterLosses | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.fused = fused_loss_applies(lm.config, fused, chunk_tokens)
        self.router = router
        self.router_stats: RouterStats | None = None

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.router is None or not self.training:
            return self._lm_loss(input_ids, targets)
        with self.router.collect() as gate_logits:
            loss = self._lm_loss(input_ids, targets)
        loss, self.router_stats = self.router.add_to(loss, gate_logits)
        return loss

    def _lm_loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.lm(input_ids, positions)
        if self.fused and torch.is_grad_enabled():
            head = self.lm.lm_head
            weight = None if isinstance(getattr(head, "weight", None), torch.Tensor) else head_weight(head)
            return fused_cross_entropy(hidden, head, targets, weight=weight)
        if not self.chunk_tokens:
            logits = self.lm.compute_logits(hidden)
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        flat, labels = hidden.flatten(0, 1), targets.flatten()
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, labels.numel(), self.chunk_tokens):
            end = start + self.chunk_tokens
            total = total + checkpoint(self._loss_sum, flat[start:end], labels[start:end], use_reentrant=False)
        return total / labels.numel()

    def _loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm.compute_logits(hidden).float(), labels, reduction="sum")


@dataclass
class MoEStep:
    """A step's MoE terms: world means of the losses, the world's expert counts [layers, experts]."""

    aux_loss: float
    z_loss: float
    counts: torch.Tensor

    @property
    def imbalance(self) -> float:
        return imbalance(self.counts)


@dataclass
class StepResult:
    step: int
    loss: float  # the LM loss (an MoE model's objective adds the terms in `moe`)
    grad_norm: float
    lr: float
    skipped: bool
    seconds: float
    tokens: int
    moe: MoEStep | None = None


@dataclass
class TrainResult:
    steps: int
    final_loss: float
    eval_loss: float | None
    losses: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    checkpoint: Path | None = None
    stopped_by_signal: bool = False
    # MoE: tokens per expert [MoE layers, experts] at this run's first and last step, the plot
    expert_load: tuple[torch.Tensor, torch.Tensor] | None = None
    expert_plot: Path | None = None


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.world = distributed.setup_world(cfg)
        self.rank = self.world.rank if self.world else 0
        self.world_size = self.world.world_size if self.world else 1
        self.out = Path(cfg.out_dir)
        self.src = resolve(cfg.model, cfg.tokenizer, lora=cfg.lora)
        self.model_config = self.src.model_config
        tok = load_tokenizer(self.src.tokenizer_dir)
        self.tokenizer_sha = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
        self.bos = self.model_config.bos_token_id
        eos = self.model_config.eos_token_ids
        self.eos_ids = list(eos) if eos else [tok.token_to_id("<|end_of_text|>") or 0]
        if cfg.seq_len > self.model_config.max_position_embeddings:
            raise StrataError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings "
                              f"({self.model_config.max_position_embeddings})")
        files = data_files(cfg.data)
        self.data = PackedWindows(tokenize(files, tok, self.bos, self.eos_ids[0], cfg.num_workers),
                                  cfg.seq_len, cfg.seed)
        self.eval_data = None
        if cfg.eval_data:
            stream = tokenize(data_files(cfg.eval_data, "--eval-data"), tok, self.bos, self.eos_ids[0],
                              cfg.num_workers)
            self.eval_data = PackedWindows(stream, cfg.seq_len, cfg.seed, "--eval-data")
        dtype, self.precision_reason = resolve_precision(cfg.precision, cfg.device)
        self.precision = Precision(dtype, cfg.device)
        self.lm = build_model(self.src, cfg.seed, None, frozen=cfg.lora, quantization=cfg.quantization,
                              group_size=cfg.quantization_group_size).to(cfg.device)
        self.lora_spec = LoRASpec.of(cfg) if cfg.lora else None
        self.lora_sites = None  # --lora: {HF module name: Site} of the targeted projections
        if self.lora_spec is not None:
            make_quantized_trainable(self.lm)
            self.lora_sites = attach_trainable(self.lm, self.lora_spec, cfg.seed, cfg.model)
        self.num_checkpointed = apply_activation_checkpointing(self.lm, cfg.activation_checkpointing, cfg.ac_every)
        # a frozen router learns nothing from the MoE terms: a LoRA run trains on the LM loss alone
        self.router = None if cfg.lora else router_losses(self.lm, self.model_config.moe, cfg.router_aux_loss_coef,
                                                          cfg.router_z_loss_coef)
        if self.router is None and (cfg.router_aux_loss_coef or cfg.router_z_loss_coef):
            logger.warning("--router-aux-loss-coef / --router-z-loss-coef ignored: %s", "the router is frozen "
                           "(--lora)" if cfg.lora else f"{cfg.model} is not an MoE model")
        self.loss_fn = LanguageModelLoss(self.lm, cfg.loss_chunk_tokens, cfg.fused_loss, self.router)
        self.module = distributed.wrap(self.loss_fn, self.lm.layers, cfg, self.world, dtype,
                                       sparse=self.router is not None)
        self.optimizer = make_optimizer(self.module, cfg)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.trainable_params = sum(p.numel() for p in self.params)
        self.flops_per_token = train_flops_per_token(self.model_config, cfg.seq_len,
                                                     self.trainable_params if cfg.lora else None)
        self.peak_flops = self._peak_flops() if self.rank == 0 else 0.0  # only rank 0 reports
        self.metrics = MetricsSink(self.out, self.rank == 0, cfg.tensorboard)
        self.spikes = SpikeDetector(cfg.spike_factor)
        self.step = 0
        self.skipped_total = 0
        self.skipped_in_row = 0
        self._stop_signal: int | None = None
        self._base_record: dict | None = None

    def close(self, clean: bool = True) -> None:
        """Leave the distributed world (the model and optimizer, which hold its groups, go
        first); `clean` after a finished run, False when a rank failed (no meeting then)."""
        if self.world is None:
            return
        self.module = self.optimizer = self.params = self.lm = None
        gc.collect()
        distributed.leave_world(self.world, clean)
        self.world = None

    # ------------------------------------------------------------ helpers

    def _peak_flops(self) -> float:
        """One rank's measured GEMM rate for the compute dtype (`strata hw`, at this process's thread
        count), for MFU against rank x world size; 0 if unknown."""
        try:
            p = probe(self.cfg.device)
        except Exception as e:  # MFU is a report, never a reason to stop
            logger.info("no hardware profile for MFU (%s)", e)
            return 0.0
        return 1e9 * (p.gemm_gflops.get(self.precision.name) or p.matmul_gflops.get(self.precision.name, 0.0))

    def _no_sync(self, last_micro: bool):
        if not last_micro and isinstance(self.module, nn.parallel.DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def _on_signal(self, signum, _frame) -> None:
        self._stop_signal = signum

    def _adapters(self):
        """--lora: every forward (and the backward's recomputations) through the adapter slot."""
        return lora_batch(LoRABatch.every_row(0)) if self.lora_spec is not None else contextlib.nullcontext()

    @property
    def base_record(self) -> dict | None:
        """--lora: the frozen base's identity (lora.base_record), hashed once."""
        if self.lora_spec is None:
            return None
        if self._base_record is None:
            self._base_record = base_record(self.src.base_name, self.src.weights_dir, self.cfg)
        return self._base_record

    @property
    def checkpoint_root(self) -> Path:
        return self.out / "checkpoints"

    # ------------------------------------------------------------ one step

    def train_step(self) -> StepResult:
        cfg, step = self.cfg, self.step
        start = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(self.optimizer, lr)
        total = 0.0
        moe = _MoESums()
        with self._adapters():
            for micro in range(cfg.grad_accum):
                first = batch_for(step, micro, self.rank, micro_batch=cfg.micro_batch_size,
                                  grad_accum=cfg.grad_accum, world_size=self.world_size)
                inputs, targets = self.data.samples(first, cfg.micro_batch_size)
                inputs, targets = inputs.to(cfg.device), targets.to(cfg.device)
                with self._no_sync(micro == cfg.grad_accum - 1), self.precision.autocast():
                    loss = self.module(inputs, targets) / cfg.grad_accum
                self.precision.scale(loss).backward()
                total += float(loss.detach())
                if self.router is not None:
                    moe.add(self.loss_fn.router_stats, cfg.grad_accum)
        self.precision.unscale(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP: a DTensor
            norm = norm.full_tensor()
        grad_norm = float(norm)
        finite = math.isfinite(grad_norm) and math.isfinite(total)
        stepped = self.precision.step(self.optimizer, finite)
        self.optimizer.zero_grad(set_to_none=True)
        moe_step = None
        if self.router is not None:  # each rank's terms are of its own tokens (transformers' way)
            total = moe.lm_loss
            moe_step = MoEStep(distributed.all_mean(moe.aux_loss, self.world, cfg.device),
                               distributed.all_mean(moe.z_loss, self.world, cfg.device),
                               distributed.all_sum(moe.counts, self.world, cfg.device))
        loss_mean = distributed.all_mean(total, self.world, cfg.device)
        tokens = cfg.tokens_per_micro_batch * cfg.grad_accum * self.world_size
        result = StepResult(step, loss_mean, grad_norm, lr, not stepped, time.perf_counter() - start, tokens,
                            moe_step)
        self.step += 1
        return result

    def _guard(self, r: StepResult) -> None:
        if r.skipped:
            self.skipped_total += 1
            self.skipped_in_row += 1
            logger.warning("step %d skipped: non-finite %s (loss %s, grad norm %s; %d in a row)", r.step,
                           "gradients" if math.isfinite(r.loss) else "loss", r.loss, r.grad_norm,
                           self.skipped_in_row)
            if self.skipped_in_row >= self.cfg.max_skipped_steps:
                raise TrainingError(
                    f"{self.skipped_in_row} non-finite steps in a row (the last at step {r.step}); lower --lr, "
                    "use --precision bfloat16 or float32, or check the data")
            return
        self.skipped_in_row = 0
        median = self.spikes.check(r.loss)
        if median is not None and self.rank == 0:
            logger.warning("loss spike at step %d: %.4f vs running median %.4f", r.step, r.loss, median)

    # ------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_data is None:
            return None
        self.module.eval()
        losses = []
        limit = self.cfg.eval_batches * self.cfg.micro_batch_size
        for inputs, targets in self.eval_data.in_order(limit, self.cfg.micro_batch_size):
            with self._adapters(), self.precision.autocast():
                losses.append(float(self.module(inputs.to(self.cfg.device), targets.to(self.cfg.device))))
        self.module.train()
        return sum(losses) / len(losses)

    # ------------------------------------------------------------ checkpoints

    def _model_state(self) -> dict[str, torch.Tensor]:
        if self.lora_spec is not None:  # the adapter alone: the base is frozen (and recorded)
            return adapter_state(self.lm)
        if self.cfg.distributed == "fsdp" and self.world is not None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            sd = {k.removeprefix("lm."): v for k, v in sd.items()}
        else:
            sd = self.lm.state_dict()
        if self.model_config.tie_word_embeddings:  # one tensor under two names (FSDP gathers two copies)
            sd.pop("lm_head.weight", None)
        return sd

    def _optimizer_state(self) -> dict:
        if self.cfg.distributed == "fsdp" and self.world is not None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
            )

            return get_optimizer_state_dict(self.module, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.optimizer.state_dict()

    def save_checkpoint(self) -> Path:
        writer = ckpt.CheckpointWriter(self.checkpoint_root, self.step)
        model_state = self._model_state()  # collective under FSDP: every rank calls it
        optim_state = self._optimizer_state()
        if self.rank == 0:
            tmp = writer.begin()
        distributed.barrier(self.world)
        tmp = writer.staging()
        rng_tensors, rng_json = ckpt.rng_state()
        writer.write_tensors(tmp, f"rng-rank{self.rank}.safetensors", rng_tensors)
        writer.write_json(tmp, f"rng-rank{self.rank}.json", rng_json)
        if self.rank == 0:
            weights = ADAPTER_FILE if self.lora_spec is not None else "model.safetensors"
            writer.write_tensors(tmp, weights, ckpt.unique_tensors(model_state))
            tensors: dict[str, torch.Tensor] = {}
            skeleton = ckpt.flatten(optim_state, tensors)
            writer.write_tensors(tmp, "optimizer.safetensors", tensors)
            state = {
                "step": self.step, "world_size": self.world_size, "optimizer": skeleton,
                "scaler": self.precision.state_dict(), "skipped_total": self.skipped_total,
                "skipped_in_row": self.skipped_in_row, "data": self._data_identity(),
                "config": self.cfg.to_json(),
            }
            if self.lora_spec is not None:
                state["lora"] = self._lora_identity()
            writer.write_json(tmp, "state.json", state)
        distributed.barrier(self.world)
        path = writer.final
        if self.rank == 0:
            path = writer.commit(self.cfg.keep_last)
            logger.info("checkpoint %s", path)
        distributed.barrier(self.world)
        return path

    def _data_identity(self) -> dict:
        """What must match for a resumed run to read the windows the interrupted one would have."""
        return {"windows": self.data.num_windows, "seq_len": self.cfg.seq_len, "seed": self.cfg.seed,
                "tokenizer_sha256": self.tokenizer_sha}

    def _lora_identity(self) -> dict:
        """What a resumed LoRA run must share with the one that wrote the checkpoint."""
        return {"adapter": self.lora_spec.to_json(), "base": self.base_record}

    def _check_lora_checkpoint(self, path: Path, state: dict) -> None:
        saved = state.get("lora")
        if (saved is None) != (self.lora_spec is None):
            kind = "a full fine-tune" if saved is None else "a LoRA run (--lora)"
            raise StrataError(f"{path} was written by {kind}; resume it the same way, or use a fresh --out-dir")
        if saved is None:
            return
        want = self._lora_identity()
        if saved["base"] != want["base"]:
            raise StrataError(f"{path}: the adapter was trained on another base ({saved['base']} vs this run's "
                              f"{want['base']}); resume with the same --model and --quantization, or use a fresh "
                              "--out-dir")
        if saved["adapter"] != want["adapter"]:
            raise StrataError(f"{path}: the adapter's settings differ ({saved['adapter']} vs {want['adapter']}); "
                              "resume with the same --lora-rank, --lora-alpha, --lora-dropout, "
                              "--lora-target-modules and --use-rslora, or use a fresh --out-dir")

    def load_checkpoint(self, path: Path) -> None:
        state = ckpt.read_json(path, "state.json")
        self._check_lora_checkpoint(path, state)
        if state["world_size"] != self.world_size:
            raise StrataError(f"{path} was written by {state['world_size']} rank(s), this run has "
                              f"{self.world_size}; resume with the same world size (or a fresh --out-dir)")
        want = self._data_identity()
        if state["data"] != want:
            raise StrataError(f"{path}: the data differ from the run that wrote it ({state['data']} vs {want}); "
                              "resume with the same --data, --tokenizer, --seq-len and --seed, or use a fresh "
                              "--out-dir")
        model_state = ckpt.read_tensors(path, ADAPTER_FILE if self.lora_spec is not None else "model.safetensors")
        optim_state = ckpt.unflatten(state["optimizer"], ckpt.read_tensors(path, "optimizer.safetensors"))
        if self.lora_spec is not None:
            load_adapter_state(self.lm, model_state, str(path))
            self.optimizer.load_state_dict(optim_state)
        elif self.cfg.distributed == "fsdp" and self.world is not None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.module, {f"lm.{k}": v for k, v in model_state.items()}, options=opts)
            set_optimizer_state_dict(self.module, self.optimizer, optim_state, options=opts)
        else:
            missing, unexpected = self.lm.load_state_dict(model_state, strict=False)
            tied = {"lm_head.weight"} if self.model_config.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise StrataError(f"{path}: model tensors do not match this model (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
            self.optimizer.load_state_dict(optim_state)
        self.precision.load_state_dict(state["scaler"])
        rank_file = f"rng-rank{self.rank}"
        ckpt.set_rng_state(ckpt.read_tensors(path, rank_file + ".safetensors"), ckpt.read_json(path, rank_file + ".json"))
        self.step = state["step"]
        self.skipped_total, self.skipped_in_row = state["skipped_total"], state["skipped_in_row"]
        logger.warning("resumed from %s (step %d)", path, self.step)

    def maybe_resume(self) -> None:
        if not self.cfg.resume:
            return
        path = ckpt.latest_intact(self.checkpoint_root)
        if path is not None:
            self.load_checkpoint(path)

    # ------------------------------------------------------------ the run

    def fit(self, progress: bool = True) -> TrainResult:
        cfg = self.cfg
        self.maybe_resume()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM,)}
        bar = None
        if progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        losses: list[float] = []
        last_ckpt = None
        eval_loss = None
        load: list[torch.Tensor] = []  # an MoE model's expert counts at this run's first and last step
        window_tokens, window_s = 0, 0.0
        try:
            with reference_kernels():  # the CPU fast paths are inference-only (no backward)
                if self.lora_spec is not None and self.step == 0 and cfg.eval_every:
                    self._log_eval()  # the base's held-out loss (B = 0: the adapter adds nothing yet)
                while self.step < cfg.max_steps:
                    r = self.train_step()
                    losses.append(r.loss)
                    if r.moe is not None:
                        load = [load[0] if load else r.moe.counts, r.moe.counts]
                    self._guard(r)
                    window_tokens += r.tokens
                    window_s += r.seconds
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{r.loss:.3f}", tok_s=f"{r.tokens / r.seconds:,.0f}",
                                        **_moe_postfix(r.moe))
                    if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                        self._log(r, window_tokens, window_s)
                        window_tokens, window_s = 0, 0.0
                    if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                        eval_loss = self._log_eval()
                    if self._stop_signal is not None:
                        last_ckpt = self.save_checkpoint()
                        logger.warning("signal %d: saved %s and stopped at step %d", self._stop_signal,
                                       last_ckpt, self.step)
                        return TrainResult(self.step, r.loss, None, losses, self.skipped_total, last_ckpt, True,
                                           *self._expert_report(load))
                    if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                        last_ckpt = self.save_checkpoint()
                last_ckpt = self.save_checkpoint()
                eval_loss = self._log_eval()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if bar is not None:
                bar.close()
            self.metrics.close()
        return TrainResult(self.step, losses[-1] if losses else float("nan"), eval_loss, losses,
                           self.skipped_total, last_ckpt, False, *self._expert_report(load))

    def _expert_report(self, load: list[torch.Tensor]) -> tuple:
        """(first, last step's expert counts) and rank 0's plot of them, or (None, None)."""
        if not load:
            return None, None
        first, last = load
        plot = None
        if self.rank == 0:
            try:
                plot = plot_histogram(first, last, self.out / "expert_load.svg")
            except Exception as e:  # a report, never a reason to fail a finished run
                logger.warning("no expert-load plot (%s)", e)
        return (first, last), plot

    def _log(self, r: StepResult, tokens: int, seconds: float) -> None:
        tok_s = tokens / seconds if seconds > 0 else 0.0
        mfu = tok_s * self.flops_per_token / (self.peak_flops * self.world_size) if self.peak_flops else 0.0
        values = {
            "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "tokens_per_s": tok_s, "mfu": mfu,
            "peak_memory_bytes": peak_memory_bytes(self.cfg.device), "loss_scale": self.precision.loss_scale(),
            "skipped_steps": self.skipped_total, "loss_spikes": self.spikes.count, "step_s": r.seconds,
        }
        if r.moe is not None:  # expert_load (pooled over the MoE layers) goes to metrics.jsonl only
            values.update(aux_loss=r.moe.aux_loss, z_loss=r.moe.z_loss, expert_imbalance=r.moe.imbalance,
                          expert_load=r.moe.counts.sum(0).tolist())
        self.metrics.log(r.step + 1, values)

    def _log_eval(self) -> float | None:
        loss = self.evaluate()
        if loss is not None:
            self.metrics.log(self.step, {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))})
            if self.rank == 0:
                logger.warning("step %d: held-out loss %.4f (perplexity %.2f)", self.step, loss, math.exp(min(loss, 50)))
        return loss

    def export(self, dest: Path, dtype: torch.dtype = torch.float32) -> Path:
        """The trained model as an HF directory (rank 0 writes; FSDP gathers the full weights first);
        --lora: the adapter as a PEFT adapter directory."""
        if self.lora_spec is not None:
            return self.export_adapter(dest, dtype)
        state = self._model_state()
        if self.rank != 0:
            return Path(dest)
        plain = CausalLM(self.model_config)
        missing, unexpected = plain.load_state_dict(state, strict=False)
        if set(missing) - {"lm_head.weight"} or unexpected:  # a bug, never the user's input
            raise RuntimeError(f"export: state dict mismatch (missing {missing}, unexpected {unexpected})")
        plain.tie_weights()
        return export_hf(plain, self.src.config, self.src.tokenizer_dir, Path(dest), self.bos, self.eos_ids, dtype)


    def export_adapter(self, dest: Path, dtype: torch.dtype = torch.float32) -> Path:
        """--lora: the PEFT adapter directory (lora.write_peft_adapter); rank 0 writes."""
        if self.rank != 0:
            return Path(dest)
        record = {"base": self.base_record, "steps": self.step, "data": self._data_identity(),
                  "command": "strata train", "config": self.cfg.to_json()}
        return write_peft_adapter(Path(dest), self.lora_spec, self.lora_sites, self.src.base_name, dtype, record)


class _MoESums:
    """A step's MoE terms summed over its micro-batches (each / grad_accum, as the loss)."""

    def __init__(self) -> None:
        self.lm_loss = self.aux_loss = self.z_loss = 0.0
        self.counts: torch.Tensor | None = None

    def add(self, stats: RouterStats, grad_accum: int) -> None:
        self.lm_loss += float(stats.lm_loss) / grad_accum
        self.aux_loss += float(stats.aux_loss) / grad_accum
        self.z_loss += float(stats.z_loss) / grad_accum
        self.counts = stats.counts if self.counts is None else self.counts + stats.counts


def _moe_postfix(moe: MoEStep | None) -> dict[str, str]:
    """The progress bar's MoE fields: the aux loss and the load imbalance (max / mean)."""
    return {} if moe is None else {"aux": f"{moe.aux_loss:.3f}", "imb": f"{moe.imbalance:.2f}"}
