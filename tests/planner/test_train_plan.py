"""`strata plan --train` and its arithmetic (strata/train/memory_plan.py) against the real thing:
autograd's saved tensors (saved_tensors_hooks) and the profiler's CPU allocations of a whole
training step, on tiny models; the CLI; and one `--measure` run of `strata train`."""

from __future__ import annotations

import json

import pytest
import torch

from strata.demo.random_models import SHAPES
from strata.graph.models.llama import CausalLM
from strata.kernels.dispatch import reference_kernels
from strata.model_config import ModelConfig
from strata.planner import train_plan
from strata.planner.train_plan import TrainPlanRequest, build_train_plan, format_train_plan
from strata.train import memory_plan
from strata.train.activation_checkpoint import apply_activation_checkpointing
from strata.train.config import TrainConfig
from strata.train.memory_plan import predict_train_memory, saved_for_backward, total_params
from strata.train.optim import make_optimizer
from strata.train.precision import Precision
from strata.train.trainer import LanguageModelLoss

BASELINE = 100 << 20  # a stand-in runtime baseline: no subprocess in these tests
TINY = dict(SHAPES["tiny"], torch_dtype="float32", max_position_embeddings=256)
FAMILIES = {
    "llama-gqa": {},
    "mha-untied": {"num_key_value_heads": 4, "tie_word_embeddings": False, "num_hidden_layers": 3},
    "qwen2-bias": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3-qk-norm": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
}


def _config(**over) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, **over})


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _window_rows(cfg: ModelConfig, batch: int, length: int) -> torch.Tensor:
    """As PackedWindows.samples: inputs and targets are views of one [B, L + 1] tensor."""
    return torch.randint(0, cfg.vocab_size, (batch, length + 1), generator=torch.Generator().manual_seed(0))


def counted_saved_bytes(cfg: ModelConfig, mode: str, dtype: torch.dtype, batch: int, length: int) -> int:
    """Bytes autograd keeps for backward after one forward of the training loss: every tensor the
    saved_tensors_hooks see (de-duplicated by storage, parameters excluded), plus the tensors nested
    in a checkpointed module's arguments (the rotary (cos, sin) tuple), which the checkpoint holds
    on its context for the recomputation, out of the hooks' sight."""
    torch.manual_seed(0)
    lm = CausalLM(cfg).train()
    apply_activation_checkpointing(lm, mode, 2)
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
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
    rows = _window_rows(cfg, batch, length)
    with reference_kernels(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            LanguageModelLoss(lm)(rows[:, :-1], rows[:, 1:])
    return sum(storages.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_count_matches_the_model(family) -> None:
    cfg = _config(**FAMILIES[family])
    model = CausalLM(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())  # tied: counted once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "full"])
def test_saved_activations_match_autograd(mode, dtype) -> None:
    cfg = _config()
    got = counted_saved_bytes(cfg, mode, dtype, batch=2, length=48)
    predicted = saved_for_backward(cfg, 48, 2, dtype, mode).total
    assert abs(predicted - got) / got < 0.10, (predicted, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "selective", "attention", "full"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama-gqa"])
def test_saved_activations_every_family_and_mode(family, mode, dtype) -> None:
    cfg = _config(**FAMILIES[family])
    got = counted_saved_bytes(cfg, mode, dtype, batch=1, length=40)
    predicted = saved_for_backward(cfg, 40, 1, dtype, mode).total
    assert abs(predicted - got) / got < 0.10, (predicted, got)


def _profiled_step_peak(cfg: ModelConfig, mode: str, dtype: torch.dtype, batch: int, length: int) -> int:
    """Peak CPU bytes allocated above the step's start during a training step (the second one: the
    optimizer's states exist by then, as in every later step), from the profiler's memory events."""
    torch.manual_seed(0)
    lm = CausalLM(cfg).train()
    apply_activation_checkpointing(lm, mode, 2)
    module = LanguageModelLoss(lm)
    optimizer, precision = make_optimizer(module, TrainConfig()), Precision(dtype, "cpu")
    rows = _window_rows(cfg, batch, length)

    def step() -> None:
        with precision.autocast():
            loss = module(rows[:, :-1], rows[:, 1:])
        precision.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with reference_kernels():
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("shape", ["large-vocab", "deep"])
def test_step_peak_matches_the_profiler(shape, mode, dtype) -> None:
    """The timeline's peak (beyond parameters and optimizer states) against a real step's: at the
    cross-entropy (a large vocabulary) or inside a checkpointed layer's backward (deep, small vocab)."""
    cfg = _config(vocab_size=4096) if shape == "large-vocab" else _config(num_hidden_layers=4, vocab_size=512)
    batch, length = 4, 64 if shape == "large-vocab" else 128
    got = _profiled_step_peak(cfg, mode, dtype, batch, length)
    m = predict_train_memory(cfg, seq_len=length, micro_batch_size=batch, compute_dtype=dtype,
                             activation_checkpointing=mode, runtime_baseline_bytes=0)
    # what the profiler sees as the step's own: no parameters or states (allocated before the
    # step), no runtime baseline, no heap retention (an RSS effect, not allocations)
    before = {"parameters (fp32 master)", "optimizer states (AdamW, 2 x fp32)", memory_plan.HEAP_SLACK,
              "data (token stream, int64)", "runtime baseline"}
    predicted = m.peak_bytes - sum(v for k, v in m.at_peak.items() if k in before)
    assert abs(predicted - got) / got < 0.15, (predicted, got, m.peak_phase)


def test_checkpointing_and_precision_order_the_activations() -> None:
    cfg = ModelConfig.from_dict(dict(SHAPES["smol-135m"], torch_dtype="float32"))
    acts = {mode: saved_for_backward(cfg, 1024, 8, torch.float32, mode).activations
            for mode in ("none", "selective", "attention", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]
    assert acts["full"] < acts["attention"] < acts["none"]
    assert acts["full"] < acts["none"] / 8
    fp32 = saved_for_backward(cfg, 1024, 8, torch.float32)
    bf16 = saved_for_backward(cfg, 1024, 8, torch.bfloat16)
    assert fp32.weight_copies == 0 and bf16.weight_copies > 0
    assert bf16.activations < fp32.activations  # the fp32 residual stream remains
    none = predict_train_memory(cfg, seq_len=1024, micro_batch_size=8, runtime_baseline_bytes=BASELINE)
    full = predict_train_memory(cfg, seq_len=1024, micro_batch_size=8, activation_checkpointing="full",
                                runtime_baseline_bytes=BASELINE)
    assert full.peak_bytes < none.peak_bytes
    assert none.peak_phase == "cross-entropy backward"  # 49k vocab: the logits' buffers dominate
    # B x L x V x 4 bytes, three times: log-softmax, its gradient, the logits' gradient
    assert none.at_peak["logits + cross-entropy"] == 3 * 4 * 8 * 1024 * cfg.vocab_size


def test_data_parallel_per_rank() -> None:
    cfg = ModelConfig.from_dict(dict(SHAPES["smol-135m"], torch_dtype="float32"))
    kw = dict(seq_len=512, micro_batch_size=4, compute_dtype=torch.bfloat16, runtime_baseline_bytes=BASELINE)
    one = predict_train_memory(cfg, **kw)
    ddp = predict_train_memory(cfg, world_size=4, distributed="ddp", ddp_bucket_mb=25, **kw)
    fsdp = predict_train_memory(cfg, world_size=4, distributed="fsdp", **kw)
    p = total_params(cfg)
    assert ddp.at_peak["gradients (fp32)"] == 4 * p  # bucket views: live all step
    assert ddp.at_peak["DDP buckets in flight"] == 2 * 25 << 20
    assert ddp.peak_bytes > one.peak_bytes
    assert fsdp.at_peak["parameters (fp32 master)"] == 4 * p // 4
    assert fsdp.at_peak["optimizer states (AdamW, 2 x fp32)"] == 8 * p // 4
    assert fsdp.components.get("autocast weight copies", 0) == 0  # FSDP casts the parameters itself
    assert fsdp.peak_bytes < one.peak_bytes


def test_plan_report_and_json(monkeypatch) -> None:
    monkeypatch.setattr(train_plan, "_target", lambda req: ("cpu", "this (cpu)", 1 << 30, 1))
    req = TrainPlanRequest(model="tiny", seq_len=64, micro_batch_size=2, precision="float32")
    plan = build_train_plan(req, runtime_baseline_bytes=BASELINE)
    text = format_train_plan(plan)
    for part in ("parameters (fp32 master)", "optimizer states", "activations (saved for backward)",
                 "logits + cross-entropy", "runtime baseline", "predicted peak", "fits", "selective (every 2)"):
        assert part in text
    data = json.loads(json.dumps(plan.to_json()))
    assert set(data["by_mode"]) == {"none", "selective", "attention", "full"}
    assert data["memory"]["peak_bytes"] == sum(data["memory"]["at_peak"].values())
    assert data["fits"] is True
    small = build_train_plan(req, runtime_baseline_bytes=1 << 30)
    assert small.fits is False and "does NOT fit" in format_train_plan(small)


def test_plan_rejects_a_sequence_past_the_positions(monkeypatch) -> None:
    monkeypatch.setattr(train_plan, "_target", lambda req: ("cpu", "this (cpu)", 1 << 30, 1))
    with pytest.raises(Exception, match="max_position_embeddings"):
        build_train_plan(TrainPlanRequest(model="tiny", seq_len=4096, micro_batch_size=1, precision="float32"))


def test_cli_plan_train_json(monkeypatch, capsys) -> None:
    from strata.cli import main

    monkeypatch.setattr(train_plan, "_target", lambda req: ("cpu", "this (cpu)", 8 << 30, 1))
    monkeypatch.setattr(memory_plan, "runtime_baseline", lambda device_type="cpu": BASELINE)
    code = main(["plan", "--train", "--model", "demo", "--seq-len", "32", "--micro-batch-size", "2",
                 "--precision", "bfloat16", "--activation-checkpointing", "selective", "--ac-every", "3",
                 "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"]["activation_checkpointing"] == "selective"
    assert data["memory"]["ac_every"] == 3
    assert data["memory"]["dtype"] == "bfloat16"
    assert data["memory"]["components"]["autocast weight copies"] > 0


def test_measure_runs_strata_train(monkeypatch) -> None:
    """--measure: a real 3-step `strata train` of the tiny shape (a word-level tokenizer, random text)."""
    monkeypatch.setattr(train_plan, "_target", lambda req: ("cpu", "this (cpu)", 8 << 30, 1))
    req = TrainPlanRequest(model="tiny", seq_len=32, micro_batch_size=2, precision="float32")
    plan = train_plan.measure(build_train_plan(req), threads=1)
    assert plan.measured_peak > 100 << 20  # an RSS: python + torch at least
    assert abs(plan.measured_error) < 0.25, (plan.memory.measurable_peak, plan.measured_peak)
    assert "measured (3-step strata train)" in format_train_plan(plan)
