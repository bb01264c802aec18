"""`strata train --check`: each check's verdict on good and bad settings, the measured data-loader
check's decision (timings injected: nothing here depends on this machine's speed), and the whole
checklist on the demo model with a small text file."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from strata.errors import ConfigError
from strata.train import memory_plan, preflight
from strata.train.config import TrainConfig
from strata.train.model_init import resolve
from strata.train.preflight import (
    FAIL,
    PASS,
    WARN,
    CheckResult,
    DataTiming,
    check_data_epochs,
    check_data_loader,
    check_grad_clip,
    check_loss_scaling,
    check_lr_schedule,
    check_memory,
    check_precision,
    check_seq_len,
    check_tf32,
    lr_samples,
    step_timing_shape,
)

BASELINE = 100 << 20  # stand-in runtime baseline: no subprocess here
LINE = re.compile(r"^(PASS|WARN|FAIL) [a-z0-9 ]+: \S")


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 400, encoding="utf-8")
    return path


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"precision": "float32", "num_workers": 0, **kw})


def test_gradient_clipping() -> None:
    assert check_grad_clip(_cfg()).status == PASS
    off = check_grad_clip(_cfg(grad_clip=0.0))
    assert off.status == FAIL and "--grad-clip" in off.fix
    assert off.line().startswith("FAIL gradient clipping: off") and ". Fix: --grad-clip 1.0" in off.line()


def test_precision_runs_autocast_and_says_what_auto_picks(monkeypatch) -> None:
    result, dtype = check_precision(_cfg(precision="bfloat16"))
    assert result.status == PASS and dtype == torch.bfloat16 and "autocast bfloat16 matmul" in result.detail
    result, dtype = check_precision(_cfg(precision="float32"))
    assert result.status == PASS and dtype == torch.float32
    monkeypatch.setattr(preflight, "resolve_precision", lambda name, device: (torch.bfloat16, "measured: faster"))
    result, _ = check_precision(_cfg(precision="auto"))
    assert "auto -> bfloat16: measured: faster" in result.detail


def test_precision_fails_when_autocast_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(preflight, "_autocast_runs", lambda dtype, device: "no kernel")
    result, dtype = check_precision(_cfg(precision="bfloat16"))
    assert result.status == FAIL and "no kernel" in result.detail and result.fix == "--precision float32"
    assert dtype == torch.float32  # the other checks go on in fp32

    def unsupported(name, device):
        raise ConfigError("--precision bfloat16: this GPU has no bf16")

    monkeypatch.setattr(preflight, "resolve_precision", unsupported)
    assert check_precision(_cfg(precision="bfloat16"))[0].status == FAIL


def test_loss_scaling() -> None:
    fp16 = check_loss_scaling(_cfg(), torch.float16)
    assert fp16.status == PASS and "GradScaler" in fp16.detail
    assert "not needed" in check_loss_scaling(_cfg(), torch.bfloat16).detail
    assert check_loss_scaling(_cfg(), torch.float32).status == PASS


def test_lr_schedule() -> None:
    cfg = _cfg(max_steps=1000, warmup_steps=50, min_lr_ratio=0.1)
    samples = lr_samples(cfg)
    steps = [s for s, _ in samples]
    assert steps[0] == 0 and steps[-1] == 999 and set(range(50)) <= set(steps)
    assert all(lr > 0 for _, lr in samples)
    good = check_lr_schedule(cfg)
    assert good.status == PASS and "warmup 50 steps" in good.detail
    constant = check_lr_schedule(_cfg(min_lr_ratio=1.0))
    assert constant.status == WARN and "--min-lr-ratio" in constant.fix
    no_warmup = check_lr_schedule(_cfg(warmup_steps=0))
    assert no_warmup.status == WARN and "--warmup-steps" in no_warmup.fix
    assert check_lr_schedule(_cfg(min_lr_ratio=0.0)).status == PASS  # decays to ~0, never to 0 in the run


def _timing(fetch_s: float, step_s: float | None) -> DataTiming:
    return DataTiming(tokens=10_000, tokenize_s=0.5, fetch_s=fetch_s, step_s=step_s, step_note="forward + backward")


def test_data_loader_decision() -> None:
    cfg = _cfg()
    assert check_data_loader(_timing(0.0005, 0.1), cfg).status == PASS  # 0.5%
    slow = check_data_loader(_timing(0.02, 0.1), cfg)  # 20% of the step
    assert slow.status == FAIL and "bottleneck" in slow.detail and slow.fix
    assert check_data_loader(_timing(0.0099, 0.1), cfg).status == PASS  # just under 10%
    untimed = check_data_loader(_timing(0.001, None), cfg)
    assert untimed.status == WARN and "not timed" in untimed.detail


def test_data_epochs() -> None:
    cfg = _cfg(max_steps=100, micro_batch_size=4, seq_len=64)  # 25,600 tokens
    assert check_data_epochs(cfg, 1_000_000).status == PASS
    many = check_data_epochs(cfg, 1_000)
    assert many.status == WARN and "25.6 epochs" in many.detail and "--max-steps 78" in many.fix


def test_tf32_and_sequence_length() -> None:
    assert check_tf32(_cfg(), torch.float32).detail == "n/a (no CUDA)"
    model = resolve("demo", None).model_config
    assert check_seq_len(_cfg(seq_len=256), model).status == PASS
    too_long = check_seq_len(_cfg(seq_len=model.max_position_embeddings + 1), model)
    assert too_long.status == FAIL and too_long.fix == f"--seq-len {model.max_position_embeddings}"


def test_memory_check_against_the_planner() -> None:
    model = resolve("demo", None).model_config
    cfg = _cfg(seq_len=512, micro_batch_size=16)
    m = memory_plan.predict_train_memory(model, seq_len=512, micro_batch_size=16, runtime_baseline_bytes=BASELINE,
                                         fused_loss=cfg.fused_loss)
    roomy = check_memory(cfg, model, torch.float32, 0, 4 * m.peak_bytes, BASELINE)
    assert cfg.fused_loss and roomy.status == PASS and "fused loss forward" in roomy.detail
    unfused = replace(cfg, fused_loss=False)
    assert "cross-entropy backward" in check_memory(unfused, model, torch.float32, 0, 8 * m.peak_bytes, BASELINE).detail
    tight = check_memory(cfg, model, torch.float32, 0, int(m.peak_bytes * 1.05), BASELINE)
    assert tight.status == WARN
    over = check_memory(cfg, model, torch.float32, 0, m.peak_bytes // 2 + BASELINE, BASELINE)
    assert over.status == FAIL and "--activation-checkpointing full" in over.fix
    hopeless = check_memory(cfg, model, torch.float32, 0, BASELINE, BASELINE)
    assert hopeless.status == FAIL and "do not suffice" in hopeless.fix


def test_step_timing_shape_caps_the_cost() -> None:
    small = resolve("demo", None).model_config
    assert step_timing_shape(_cfg(seq_len=64, micro_batch_size=2), small) == (2, 64)
    big = resolve("smol-135m", None).model_config
    batch, length = step_timing_shape(_cfg(seq_len=1024, micro_batch_size=8), big)
    assert batch * length < 8 * 1024


def test_whole_checklist_on_the_demo_model(text_file) -> None:
    cfg = _cfg(data=[str(text_file)], seq_len=32, micro_batch_size=2, max_steps=20, warmup_steps=2)
    results = preflight.preflight(cfg, capacity=8 << 30, runtime_baseline_bytes=BASELINE)
    names = [r.name for r in results]
    assert names == ["gradient clipping", "precision", "loss scaling", "lr schedule", "data loader", "data epochs",
                     "tf32", "sequence length", "memory"]
    by_name = {r.name: r for r in results}
    assert all(isinstance(r, CheckResult) and LINE.match(r.line()) for r in results)
    assert by_name["data loader"].status in (PASS, FAIL)  # measured: the verdict is the machine's
    assert "ms" in by_name["data loader"].detail and "tokenizing took" in by_name["data loader"].detail
    assert by_name["data epochs"].status == PASS  # 20 x 2 x 32 tokens of ~3,600
    assert all(by_name[n].status == PASS for n in ("gradient clipping", "precision", "loss scaling",
                                                  "lr schedule", "tf32", "sequence length", "memory"))


def test_run_checks_prints_lines_and_exit_code(text_file, monkeypatch, capsys) -> None:
    monkeypatch.setattr(preflight, "device_memory", lambda device: 8 << 30)
    monkeypatch.setattr(memory_plan, "runtime_baseline", lambda device_type="cpu": BASELINE)
    base = dict(data=[str(text_file)], seq_len=32, micro_batch_size=2, max_steps=20, warmup_steps=2)
    monkeypatch.setattr(preflight, "time_step", lambda cfg, src, dtype: (1.0, "forward + backward"))
    assert preflight.run_checks(_cfg(**base)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and all(LINE.match(line) for line in lines)
    assert preflight.run_checks(_cfg(grad_clip=0.0, **base)) == 1
    assert "FAIL gradient clipping" in capsys.readouterr().out


def test_bad_paths_are_config_errors(text_file) -> None:
    with pytest.raises(ConfigError, match="no such file or directory"):
        preflight.preflight(_cfg(data=["/nonexistent/corpus"]), capacity=8 << 30, runtime_baseline_bytes=BASELINE)
    with pytest.raises(ConfigError, match="--model"):
        preflight.preflight(_cfg(model="/nonexistent/model", data=[str(text_file)]), capacity=8 << 30,
                            runtime_baseline_bytes=BASELINE)


def test_cli_check_flag(text_file, monkeypatch, capsys) -> None:
    from strata.cli import main

    monkeypatch.setattr(preflight, "device_memory", lambda device: 8 << 30)
    monkeypatch.setattr(memory_plan, "runtime_baseline", lambda device_type="cpu": BASELINE)
    monkeypatch.setattr(preflight, "time_step", lambda cfg, src, dtype: (1.0, "forward + backward"))
    code = main(["train", "--check", "--data", str(text_file), "--seq-len", "32", "--micro-batch-size", "2",
                 "--precision", "float32", "--num-workers", "0", "--grad-clip", "0"])
    assert code == 1
    assert "FAIL gradient clipping" in capsys.readouterr().out
