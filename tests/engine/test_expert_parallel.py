"""Expert parallelism end to end: LLM(tensor_parallel_size=2, enable_expert_parallel=True) on local
ranks equals one process token for token (logprobs within 1e-4) for every MoE family that shards,
under chunked prefill and preemption; refusals name the fix; a killed rank is a clear error."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import make_llm

from strata import SamplingParams
from strata.engine.parallel import RankDied
from strata.errors import ConfigError
from tests.engine.test_tp_engine import _assert_same, _run, _tokens, no_leftovers  # noqa: F401

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "qwen3moe"])
def test_ep2_equals_one_process(family, tiny_models, prompt_of, no_leftovers):  # noqa: F811
    model = tiny_models[family]  # 4 / 8 / 8 experts, 2 / 4 / 4 on each rank; qwen2moe: a dense layer too
    prompts = [prompt_of(i, n) for i, n in enumerate([7, 23, 40])]
    ref, _ = _run(model, prompts)
    got, _ = _run(model, prompts, tensor_parallel_size=2, enable_expert_parallel=True)
    _assert_same(ref, got)
    # one sequence decoding: one token a step, so one rank's slice of the tokens is empty
    ref, _ = _run(model, prompts[:1])
    got, _ = _run(model, prompts[:1], tensor_parallel_size=2, enable_expert_parallel=True)
    _assert_same(ref, got)


def test_ep2_chunked_prefill_and_preemption(tiny_models, prompt_of, no_leftovers):  # noqa: F811
    model = tiny_models["qwen3moe"]
    prompts = [prompt_of(100 + i, n) for i, n in enumerate([40, 7, 55, 23, 31])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(kv_cache_memory=model.kv_bytes_for(96) // 2, max_num_batched_tokens=32, enable_prefix_caching=False)
    ref, _ = _run(model, prompts, params, **{**kw, "kv_cache_memory": model.kv_bytes_for(96)})
    got, preempted = _run(model, prompts, params, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    assert preempted > 0
    assert _tokens(got) == _tokens(ref)


@pytest.mark.parametrize("family,kw,needle", [
    ("qwen3moe", {}, "add it, or use tensor_parallel_size 1"),  # MoE + TP without EP
    ("olmoe", {"enable_expert_parallel": True}, "q/k norms span every head"),
    ("mixtral", {"enable_expert_parallel": True, "tensor_parallel_size": 3}, "4 experts do not split evenly"),
])
def test_refusals_name_the_fix(family, kw, needle, tiny_models, no_leftovers):  # noqa: F811
    opts = {"tensor_parallel_size": 2, **kw}
    with pytest.raises(ConfigError, match=needle):
        make_llm(tiny_models[family], **opts)


def test_killed_rank_is_a_clear_error(tiny_models, prompt_of, no_leftovers):  # noqa: F811
    llm = make_llm(tiny_models["mixtral"], tensor_parallel_size=2, enable_expert_parallel=True, comm_timeout=10.0)
    try:
        worker = llm.engine.ranks.procs[0]
        llm.generate([prompt_of(1, 8)], GREEDY, use_tqdm=False)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        t0 = time.monotonic()
        with pytest.raises(RankDied, match=r"rank 1 exited \(killed by signal 9\)"):
            llm.generate([prompt_of(2, 8)], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 15
    finally:
        llm.close()
