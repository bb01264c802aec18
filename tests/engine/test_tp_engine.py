"""Tensor parallelism end to end: LLM(tensor_parallel_size=2) on gloo ranks over loopback equals
tensor_parallel_size=1 token for token (logprobs within 1e-4), for every family, with int8
weights, under chunked prefill and preemption, across two torchrun "hosts"; a killed rank is a
clear error, and no process is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import make_llm

from strata import SamplingParams
from strata.comm.world import free_port
from strata.engine.parallel import RankDied

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture
def no_leftovers():
    """No process this test started outlives it (ones an earlier test left are not this test's)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def started_here():
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]

    yield
    deadline = time.monotonic() + 15
    while started_here() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = started_here()
    for p in left:
        p.kill()
    assert not left, f"processes left behind: {left}"


def _run(model, prompts, params=GREEDY, **kw):
    llm = make_llm(model, **kw)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.engine.scheduler.num_preemptions
    finally:
        llm.close()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_same(ref, got):
    assert _tokens(got) == _tokens(ref)
    for a, b in zip(ref, got):
        for ca, cb in zip(a.outputs, b.outputs):
            for la, lb in zip(ca.logprobs, cb.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[k] - lb[k]) < 1e-4 for k in la)


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_tp2_equals_tp1(family, tiny_models, prompt_of, no_leftovers):
    model = tiny_models[family]  # llama3: one KV head, replicated on both ranks; qwen3: head_dim 32
    prompts = [prompt_of(i, n) for i, n in enumerate([7, 23, 40])]
    ref, _ = _run(model, prompts)
    got, _ = _run(model, prompts, tensor_parallel_size=2)
    _assert_same(ref, got)


def test_tp2_int8_equals_tp1_int8(tiny_models, prompt_of, no_leftovers, monkeypatch):
    # The fast CPU paths round per rank (int8 activations per 64 columns, where a shard's width
    # allows; bf16 prefill GEMMs round each rank's partial sums), so equality is asked of the exact
    # weight-only arithmetic; the ranks inherit the environment.
    monkeypatch.setenv("STRATA_INT8_FP32_ACTIVATIONS", "1")
    monkeypatch.setenv("STRATA_PREFILL_GEMM", "aten")
    model = tiny_models["qwen2"]
    prompts = [prompt_of(i, n) for i, n in enumerate([9, 30])]
    ref, _ = _run(model, prompts, quantization="int8")
    got, _ = _run(model, prompts, quantization="int8", tensor_parallel_size=2)
    assert _tokens(got) == _tokens(ref)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tp2_chunked_prefill_and_preemption(mode, tiny_models, prompt_of, no_leftovers):
    model = tiny_models["llama"]
    prompts = [prompt_of(100 + i, n) for i, n in enumerate([40, 7, 55, 23, 31])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(kv_cache_memory=model.kv_bytes_for(96) // 2, max_num_batched_tokens=32, preemption_mode=mode,
              swap_space=model.kv_bytes_for(256), enable_prefix_caching=False)
    ref, _ = _run(model, prompts, params, **{**kw, "kv_cache_memory": model.kv_bytes_for(96)})
    got, preempted = _run(model, prompts, params, tensor_parallel_size=2, **kw)
    assert preempted > 0
    assert _tokens(got) == _tokens(ref)


def test_killed_rank_is_a_clear_error(tiny_models, prompt_of, no_leftovers):
    llm = make_llm(tiny_models["llama"], tensor_parallel_size=2, comm_timeout=10.0)
    try:
        worker = llm.engine.ranks.procs[0]
        llm.generate([prompt_of(1, 8)], GREEDY, use_tqdm=False)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        t0 = time.monotonic()
        with pytest.raises(RankDied, match=r"rank 1 exited \(killed by signal 9\)"):
            llm.generate([prompt_of(2, 8)], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 15
        with pytest.raises(RankDied, match="failed earlier"):
            llm.generate([prompt_of(3, 8)], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_two_torchrun_hosts_give_the_same_tokens(tiny_models, prompt_of, tmp_path, no_leftovers):
    """Two torchrun launches (--nnodes 2, one process each) on loopback, as two hosts would run."""
    model = tiny_models["qwen3"]
    prompt = prompt_of(7, 12)
    ref, _ = _run(model, [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    port = free_port()
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_token_ids": prompt}) + "\n")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
              "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0"]
    cmd = ["-m", "strata", "generate", "--model", str(model.path), "--dtype", "float32",
           "--max-model-len", "96", "--kv-cache-memory", "1MiB", "--threads", "1",
           "--tensor-parallel-size", "2", "--max-tokens", "10", "--ignore-eos", "--temperature", "0",
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    hosts = [subprocess.Popen([*launch, "--node-rank", str(r), *cmd], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outs = [h.communicate(timeout=180)[0].decode() for h in hosts]
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
                h.wait()
    assert [h.returncode for h in hosts] == [0, 0], "\n".join(outs)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows[0]["outputs"][0]["token_ids"] == ref[0].outputs[0].token_ids
