"""Preemption by swap and by recompute: same greedy outputs as transformers, nothing leaks."""

import pytest
from conftest import hf_greedy, make_llm

from strata import SamplingParams


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_oversubscribed_outputs_match_reference(mode, family, tiny_models, prompt_of):
    model = tiny_models[family]
    prompts = [prompt_of(i, n) for i, n in enumerate([40, 7, 55, 23, 31])]
    refs = [hf_greedy(model, p, 24, stop_at_eos=False) for p in prompts]
    llm = make_llm(model, kv_cache_memory=model.kv_bytes_for(96), max_num_batched_tokens=32,
                   preemption_mode=mode, swap_space=model.kv_bytes_for(256), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    swapper = engine.runner.swapper
    if mode == "swap":
        assert engine.scheduler.num_swapped_out > 0 and swapper.blocks_in == swapper.blocks_out > 0
    if mode == "recompute":
        assert swapper is None and engine.scheduler.num_swapped_out == 0
    engine.check_blocks()
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    if engine.host_pool is not None:
        assert engine.host_pool.num_free == engine.host_pool.num_blocks


def test_abort_while_swapped_frees_host_blocks(tiny_models, prompt_of):
    model = tiny_models["llama"]
    llm = make_llm(model, kv_cache_memory=model.kv_bytes_for(96), max_num_batched_tokens=32,
                   preemption_mode="swap", swap_space=model.kv_bytes_for(256), enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate([40, 30, 35, 20]):
        engine.add_request(str(i), None, prompt_of(i, n), params)
    for _ in range(200):
        engine.step()
        engine.check_blocks()
        if engine.scheduler.swapped:
            break
    assert engine.scheduler.swapped, "expected a sequence to be swapped out"
    victim = engine.scheduler.swapped[0].request.request_id
    engine.abort(victim)
    engine.check_blocks()
    while engine.has_unfinished():
        engine.step()
    engine.runner.swapper.wait()
    engine.check_blocks()
    assert engine.host_pool.num_free == engine.host_pool.num_blocks
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
