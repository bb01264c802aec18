"""Data parallel training over gloo: 2 DDP ranks (and 2 FSDP2 ranks) compute what one process
accumulating 2 micro-batches computes; every rank is reaped."""

from __future__ import annotations

import json

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



MOE_COEFS = ("--router-aux-loss-coef", "0.1", "--router-z-loss-coef", "0.01")


@pytest.fixture(scope="module")
def moe_single_process(tiny_moe_dir, tmp_path_factory):
    """A 32-expert top-1 MoE (64 tokens a rank: some experts idle on a rank, so without a
    gradient there, which the ranks must reduce anyway) run by one process accumulating 2."""
    d = tmp_path_factory.mktemp("moe")
    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    cfg.update(num_experts=32, num_experts_per_tok=1)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "train.txt").write_text((tiny_moe_dir / "train.txt").read_text())
    done = run_train_subprocess(train_argv(d, d / "one", "--grad-accum", "2", *MOE_COEFS))
    assert done.returncode == 0, done.stderr[-3000:]
    return d


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_moe_ranks_match_one_process_with_accumulation(moe_single_process, mode):
    # each rank's aux loss and z-loss are of its own tokens (transformers' way), like each
    # micro-batch's in the accumulating process. Without find_unused_parameters (DDP) or
    # reduce_scatter_unused_params (FSDP2) the ranks' collectives do not match and the run fails.
    # DDP leaves an expert idle on every rank without a gradient, as one process does (AdamW skips
    # it); FSDP2 gives it zeros, so AdamW moves it on its momentum: close, not equal.
    d = moe_single_process
    done = run_train_subprocess(train_argv(d, d / mode, "--nproc-per-node", "2", "--distributed", mode, *MOE_COEFS))
    assert done.returncode == 0, done.stderr[-3000:]
    ref, got = metrics(d / "one"), metrics(d / mode)
    assert sorted(got) == [1, 2, 3, 4, 5]
    rel = 1e-5 if mode == "ddp" else 1e-3
    for step in ref:
        for key in ("loss", "aux_loss", "z_loss"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=rel, abs=1e-6), (step, key)
    assert got[1]["expert_load"] == ref[1]["expert_load"]  # the world's counts: the same tokens, weights
    if mode == "ddp":
        a, b = _final(d / "one"), _final(d / mode)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
