"""Checkpoints: a run SIGKILLed after step 5 and resumed computes steps 6-10 bit for bit like the
uninterrupted run; a damaged newest checkpoint is detected and the previous one used; SIGTERM
saves and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from strata.train import checkpoint as ckpt
from tests.train.train_fixtures import metrics, run_train_subprocess, train_argv

# big enough that a step takes a while, so the kill lands mid-run
SLOWER = ("--seq-len", "128", "--micro-batch-size", "8", "--max-steps", "10", "--save-every", "5",
          "--keep-last", "3", "--warmup-steps", "2")


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def _kill_after_checkpoint(argv: list[str], out: Path, step: int, timeout: float = 120) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "strata", *argv], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    manifest = out / "checkpoints" / f"step-{step:08d}" / ckpt.MANIFEST
    try:
        deadline = time.monotonic() + timeout
        while not manifest.is_file():
            assert proc.poll() is None, "training exited before the checkpoint appeared"
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_resume_after_sigkill_is_bit_identical(tiny_train_dir, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = run_train_subprocess(train_argv(tiny_train_dir, straight, *SLOWER))
    assert done.returncode == 0, done.stderr[-2000:]

    code = _kill_after_checkpoint(train_argv(tiny_train_dir, killed, *SLOWER), killed, 5)
    assert code == -signal.SIGKILL
    assert not (killed / "checkpoints" / "step-00000010").exists(), "the kill came too late to test resume"
    resumed = run_train_subprocess(train_argv(tiny_train_dir, killed, *SLOWER))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step-00000005" in resumed.stderr

    a, b = metrics(straight), metrics(killed)
    for step in range(6, 11):
        assert a[step]["loss"] == b[step]["loss"], step  # bit-identical floats
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step
    wa, wb = _weights(straight, 10), _weights(killed, 10)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tiny_train_dir, tmp_path, caplog):
    out = tmp_path / "run"
    argv = train_argv(tiny_train_dir, out, "--max-steps", "6", "--save-every", "3", "--keep-last", "3")
    assert run_train_subprocess(argv).returncode == 0
    root = out / "checkpoints"
    newest = root / "step-00000006" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated mid-write
    assert "truncated" in ckpt.verify(root / "step-00000006")
    assert ckpt.latest_intact(root) == root / "step-00000003"
    assert "damaged" in caplog.text
    # an unfinished write (no manifest) is passed over the same way
    partial = root / "step-00000009"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 16)
    assert ckpt.latest_intact(root) == root / "step-00000003"
    resumed = run_train_subprocess(argv)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-00000003" in resumed.stderr and "damaged" in resumed.stderr


def test_sigterm_saves_a_checkpoint_and_stops(tiny_train_dir, tmp_path):
    out = tmp_path / "run"
    argv = train_argv(tiny_train_dir, out, *SLOWER, "--max-steps", "1000", "--save-every", "0")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "strata", *argv], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    saved = ckpt.latest_intact(out / "checkpoints")
    assert saved is not None
    state = json.loads((saved / "state.json").read_text())
    assert 1 <= state["step"] < 1000


def test_checkpoints_hold_no_pickles(tiny_train_dir, tmp_path):
    out = tmp_path / "run"
    assert run_train_subprocess(train_argv(tiny_train_dir, out, "--max-steps", "2")).returncode == 0
    files = {p.name for p in ckpt.checkpoint_dirs(out / "checkpoints")[0].iterdir()}
    assert files == {"model.safetensors", "optimizer.safetensors", "rng-rank0.safetensors", "rng-rank0.json",
                     "state.json", "manifest.json"}
