"""`strata train --lora` over 2 DDP ranks (gloo) computes what one process accumulating 2
micro-batches computes: the same losses and the same adapter; FSDP is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.train.test_train_lora import make_base
from tests.train.train_fixtures import metrics, run_train_subprocess, train_argv


@pytest.fixture(scope="module")
def base(tiny_train_dir, tmp_path_factory):
    return make_base(tiny_train_dir, tmp_path_factory.mktemp("lora-ddp") / "base", seed=0)


def _argv(tiny_train_dir, base, out, *extra):
    argv = train_argv(tiny_train_dir, out, "--lora", "--lora-rank", "4", "--lr", "1e-2", *extra)
    argv[argv.index("--model") + 1] = str(base)
    return argv


def test_two_ddp_ranks_equal_one_process_with_accumulation(tiny_train_dir, base, tmp_path):
    one = run_train_subprocess(_argv(tiny_train_dir, base, tmp_path / "one", "--grad-accum", "2"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_train_subprocess(_argv(tiny_train_dir, base, tmp_path / "two", "--nproc-per-node", "2"))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "x 2 rank(s)" in two.stderr
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5, abs=1e-6), step
    a = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fsdp_is_refused_with_the_fix(tiny_train_dir, base, tmp_path):
    done = run_train_subprocess(_argv(tiny_train_dir, base, tmp_path / "fsdp", "--nproc-per-node", "2",
                                      "--distributed", "fsdp"))
    assert done.returncode != 0
    assert "--lora with --distributed fsdp is not supported" in done.stderr and "use --distributed ddp" in done.stderr
