"""Data parallel training over gloo: 2 DDP ranks (and 2 FSDP2 ranks) compute what one process
accumulating 2 micro-batches computes; every rank is reaped."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.train.train_fixtures import metrics, run_train_subprocess, train_argv


def _final(out, step=5):
    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def single_process_accumulating(tiny_train_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    done = run_train_subprocess(train_argv(tiny_train_dir, out, "--grad-accum", "2"))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process_with_accumulation(tiny_train_dir, tmp_path, single_process_accumulating, mode):
    out = tmp_path / mode
    done = run_train_subprocess(train_argv(tiny_train_dir, out, "--nproc-per-node", "2", "--distributed", mode))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x 2 rank(s)" in done.stderr
    ref, got = metrics(single_process_accumulating), metrics(out)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6), step
    a, b = _final(single_process_accumulating), _final(out)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ddp_bf16_gradient_compression_trains(tiny_train_dir, tmp_path, single_process_accumulating):
    out = tmp_path / "bf16-comm"
    done = run_train_subprocess(train_argv(tiny_train_dir, out, "--nproc-per-node", "2", "--ddp-comm-dtype",
                                           "bfloat16"))
    assert done.returncode == 0, done.stderr[-3000:]
    ref, got = metrics(single_process_accumulating), metrics(out)
    assert got[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-6)  # same weights before any update
    assert got[5]["loss"] == pytest.approx(ref[5]["loss"], rel=1e-2)  # bf16 gradients: close, not equal
