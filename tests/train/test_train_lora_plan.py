"""`strata plan --train --lora` (strata/train/memory_plan.py's LoRA terms) against the real thing:
the adapter's parameter count, autograd's saved tensors with the base frozen (fp32, bf16, int8;
every checkpointing mode; partial targets; dropout), the profiler's allocations of a whole step,
the CLI, and one measured `strata train --lora` run within 15%."""

from __future__ import annotations

import json

import pytest
import torch

from strata.demo.random_models import SHAPES
from strata.graph.lora import LoRABatch, lora_batch
from strata.graph.models.llama import CausalLM
from strata.kernels.dispatch import reference_kernels
from strata.memory.quant import quantize_model
from strata.model_config import ModelConfig
from strata.planner import train_plan
from strata.planner.train_plan import TrainPlanRequest, build_train_plan, format_train_plan
from strata.train import memory_plan
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import LORA_TARGETS, TrainConfig
from strata.train.lora import LoRASpec, attach_trainable, make_quantized_trainable
from strata.train.memory_plan import LoRAPlan, lora_params, predict_train_memory, saved_for_backward
from strata.train.optim import make_optimizer
from strata.train.trainer import LanguageModelLoss

BASELINE = 100 << 20
TINY = dict(SHAPES["tiny"], torch_dtype="float32", max_position_embeddings=256)
FAMILIES = {
    "llama-gqa": {},
    "mha-untied": {"num_key_value_heads": 4, "tie_word_embeddings": False, "num_hidden_layers": 3},
    "qwen2-bias": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3-qk-norm": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
}
TARGETS = {"all": LORA_TARGETS, "q-v": ("q_proj", "v_proj"), "o": ("o_proj",), "up-down": ("up_proj", "down_proj")}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(**over) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, **over})


def _lora_model(cfg: ModelConfig, plan: LoRAPlan, mode: str) -> CausalLM:
    torch.manual_seed(0)
    lm = CausalLM(cfg).train()
    if plan.quantization:
        quantize_model(lm, plan.quantization, plan.group_size)
        make_quantized_trainable(lm)
    attach_trainable(lm, LoRASpec(plan.rank, 16.0, plan.dropout, plan.target_modules, False), seed=0)
    apply_activation_checkpointing(lm, mode, 2)
    return lm


def counted_saved_bytes(cfg: ModelConfig, plan: LoRAPlan, mode: str, dtype: torch.dtype, batch: int,
                        length: int) -> int:
    """As tests/planner/test_train_plan.py counts them: storages the saved_tensors_hooks see
    (parameters and the frozen base's buffers excluded), plus a checkpoint's tuple inputs."""
    lm = _lora_model(cfg, plan, mode)
    owned = {t.untyped_storage().data_ptr() for t in (*lm.parameters(), *lm.buffers())}
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in owned:
            storages[s.data_ptr()] = s.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def checkpoint_inputs(_module, args) -> None:
        for a in args:
            for t in a if isinstance(a, tuple) else (a,):
                if isinstance(t, torch.Tensor):
                    keep(t)

    for m in lm.modules():
        if type(m).__name__ == "CheckpointWrapper":
            m.register_forward_pre_hook(checkpoint_inputs)
    rows = torch.randint(0, cfg.vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(0))
    with reference_kernels(), lora_batch(LoRABatch.every_row(0)), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            LanguageModelLoss(lm)(rows[:, :-1], rows[:, 1:])
    return sum(storages.values())


@pytest.mark.parametrize("family", [*FAMILIES, "tiny-moe"])
def test_adapter_parameter_count_matches_the_banks(family) -> None:
    cfg = ModelConfig.from_dict(dict(SHAPES["tiny-moe"], torch_dtype="float32")) if family == "tiny-moe" \
        else _config(**FAMILIES[family])
    targets = ("all-linear",) if family == "tiny-moe" else LORA_TARGETS  # an MoE: attention only
    for t in (targets, ("q_proj", "v_proj")):
        plan = LoRAPlan(rank=8, target_modules=t)
        lm = _lora_model(cfg, plan, "none")
        assert lora_params(cfg, plan) == sum(p.numel() for p in lm.parameters() if p.requires_grad), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "attention", "full"])
@pytest.mark.parametrize("targets", TARGETS)
def test_saved_activations_match_autograd(targets, mode, dtype) -> None:
    cfg = _config()
    plan = LoRAPlan(rank=8, target_modules=TARGETS[targets])
    got = counted_saved_bytes(cfg, plan, mode, dtype, batch=2, length=48)
    predicted = saved_for_backward(cfg, 48, 2, dtype, mode, lora=plan).total
    assert abs(predicted - got) / got < 0.10, (predicted, got)


@pytest.mark.parametrize("case", ["dropout", "int8-base", "int4-base-bf16", "qwen3-qk-norm", "mha-untied"])
def test_saved_activations_other_cases(case) -> None:
    cfg, dtype = _config(), torch.float32
    plan = LoRAPlan(rank=8)
    if case == "dropout":
        plan = LoRAPlan(rank=8, dropout=0.1)
    elif case.startswith("int"):
        plan = LoRAPlan(rank=8, quantization=case[:4], group_size=32)
        dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    else:
        cfg = _config(**FAMILIES[case])
    for mode in ("none", "full"):
        got = counted_saved_bytes(cfg, plan, mode, dtype, batch=2, length=40)
        predicted = saved_for_backward(cfg, 40, 2, dtype, mode, lora=plan).total
        assert abs(predicted - got) / got < 0.10, (mode, predicted, got)


def _profiled_step_peak(cfg: ModelConfig, plan: LoRAPlan, mode: str, batch: int, length: int, fused: bool,
                        dtype: torch.dtype = torch.float32) -> int:
    """Peak CPU bytes allocated above the start of a LoRA training step (the second one)."""
    lm = _lora_model(cfg, plan, mode)
    module = LanguageModelLoss(lm, fused=fused)
    optimizer = make_optimizer(module, TrainConfig())
    params = [p for p in module.parameters() if p.requires_grad]
    rows = torch.randint(0, cfg.vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with lora_batch(LoRABatch.every_row(0)), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = module(rows[:, :-1], rows[:, 1:])
        with lora_batch(LoRABatch.every_row(0)):
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with reference_kernels():
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    live = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("fused", [True, False], ids=["fused-loss", "unfused-loss"])
@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("quantization", [None, "int8", "bf16-autocast"])
def test_step_peak_matches_the_profiler(quantization, mode, fused) -> None:
    cfg = _config(vocab_size=4096)
    dtype = torch.bfloat16 if quantization == "bf16-autocast" else torch.float32
    plan = LoRAPlan(rank=16, quantization=None if dtype == torch.bfloat16 else quantization, group_size=32)
    got = _profiled_step_peak(cfg, plan, mode, 4, 64, fused, dtype)
    m = predict_train_memory(cfg, seq_len=64, micro_batch_size=4, activation_checkpointing=mode,
                             runtime_baseline_bytes=0, fused_loss=fused, lora=plan, compute_dtype=dtype)
    before = {k for k in m.at_peak if k.startswith(("base weights", "LoRA adapter", "optimizer states", "gradients",
                                                     "data", "runtime"))} | {memory_plan.HEAP_SLACK}
    predicted = m.peak_bytes - sum(v for k, v in m.at_peak.items() if k in before)
    assert abs(predicted - got) / got < 0.15, (predicted, got, m.peak_phase)


def test_plan_prices_the_frozen_base_and_the_adapter(monkeypatch, capsys) -> None:
    from strata.cli import main

    monkeypatch.setattr(train_plan, "_target", lambda req: ("cpu", "this (cpu)", 8 << 30, 1))
    monkeypatch.setattr(memory_plan, "runtime_baseline", lambda device_type="cpu": BASELINE)
    assert main(["plan", "--train", "--lora", "--model", "demo", "--seq-len", "64", "--micro-batch-size", "2",
                 "--precision", "float32", "--quantization", "int8", "--lora-rank", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["memory"]
    cfg = train_plan.resolve_train_model("demo")
    n = lora_params(cfg, LoRAPlan(rank=8))
    assert data["trainable_params"] == n and data["lora"]["quantization"] == "int8"
    parts = data["components"]
    assert parts["LoRA adapter (fp32)"] == 4 * n and parts["gradients (fp32)"] == 4 * n
    assert parts["optimizer states (AdamW, 2 x fp32)"] == 8 * n
    assert 0 < parts["base weights (frozen, int8)"] < cfg.num_params() * 4 / 3  # ~1 byte a projection weight
    assert "parameters (fp32 master)" not in parts
    full = predict_train_memory(cfg, seq_len=64, micro_batch_size=2, runtime_baseline_bytes=BASELINE)
    assert data["peak_bytes"] < full.peak_bytes

    req = TrainPlanRequest(model="demo", seq_len=64, micro_batch_size=2, precision="float32", lora=True,
                           lora_rank=8, lora_target_modules=("q_proj", "v_proj"))
    text = format_train_plan(build_train_plan(req, runtime_baseline_bytes=BASELINE))
    assert "LoRA rank 8 on q_proj v_proj" in text and "base weights (frozen, fp32)" in text
    with pytest.raises(Exception, match="add --lora"):
        build_train_plan(TrainPlanRequest(model="demo", seq_len=64, micro_batch_size=2, quantization="int8"))
    with pytest.raises(Exception, match="use --distributed ddp"):
        build_train_plan(TrainPlanRequest(model="demo", seq_len=64, micro_batch_size=2, lora=True, world_size=2,
                                          distributed="fsdp"), runtime_baseline_bytes=BASELINE)


def test_measured_lora_run_is_within_15_percent(monkeypatch) -> None:
    """A real 3-step `strata train --lora` of the demo checkpoint (int8 base) against the plan."""
    monkeypatch.setattr(train_plan, "_target", lambda req: ("cpu", "this (cpu)", 8 << 30, 1))
    req = TrainPlanRequest(model="demo", seq_len=128, micro_batch_size=4, precision="float32", lora=True,
                           quantization="int8")
    plan = train_plan.measure(build_train_plan(req), threads=2)
    assert abs(plan.measured_error) < 0.15, (plan.memory.measurable_peak, plan.measured_peak, list(plan.memory.at_peak.items())[4:])
