"""Prefix caching end to end.

Against transformers: prompts that share a prefix give the same greedy tokens from a warm cache
as from a cold one and as transformers' plain forward, with the hits visible in the block
manager's stats, under chunked prefill, n > 1, preemption, eviction and abort; with
enable_prefix_caching=False nothing is cached. Without a model: the real Scheduler and
BlockManager drive a fake KV store (block slots holding token ids) under random workloads, and
every step checks that attention would read exactly the sequence's own tokens and that no token
is ever written into a shared or cached block.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from strata import SamplingParams
from strata.engine.lifecycle import SequenceLifecycle
from strata.engine.request import Request, Sequence
from strata.engine.sampler import SamplerOutput
from strata.engine.scheduler import Scheduler
from strata.errors import ConfigError
from strata.memory.blocks import BlockManager

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _shared(prompt_of, seed: int, prefix_len: int, suffix_lens) -> list[list[int]]:
    prefix = prompt_of(seed, prefix_len)
    return [prefix + prompt_of(seed + 1 + i, n) for i, n in enumerate(suffix_lens)]


def _tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def _all_unowned(llm) -> None:
    bm = llm.engine.block_manager
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.num_free == bm.num_blocks  # free or cached, none owned


def test_warm_cache_matches_cold_and_hf(tiny_model, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(tiny_model)
    bm = llm.engine.block_manager
    prompts = _shared(prompt_of, 2000, 37, (5, 12, 1, 30))  # 2 full prefix blocks of 16
    cold = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert bm.stats.hits == 0 and bm.num_cached > 0
    warm = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert bm.stats.hits == 2 * len(prompts)  # each prompt shares the prefix's two full blocks
    for i, (p, o) in enumerate(zip(prompts, warm)):
        assert o.outputs[0].token_ids == hf_ref(tiny_model, p, MAX_NEW), f"prompt {i}"
    assert warm[0].outputs[0].token_ids == cold.outputs[0].token_ids
    engine_clean(llm)
    _all_unowned(llm)
    assert bm.num_cached > 0


def test_hits_on_blocks_of_running_requests(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    """Budget 16: the second request is admitted while the first still runs, sharing its blocks."""
    llm = llm_factory(llama, max_num_batched_tokens=16)
    prompts = _shared(prompt_of, 2100, 40, (3, 9, 17))
    shared_refs = []
    execute = llm.engine.runner.execute

    def spy(out):
        bm = llm.engine.block_manager
        shared_refs.extend(bm.ref_count(s.seq.block_table[0]) for s in out.scheduled if s.seq.block_table)
        return execute(out)

    llm.engine.runner.execute = spy
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(llama, p, MAX_NEW)
    assert llm.engine.block_manager.stats.hits >= 4
    assert max(shared_refs) >= 2  # a prefix block owned by two running requests at once
    engine_clean(llm)


@pytest.mark.parametrize(("length", "hits"), [(16, 0), (17, 1), (32, 1), (33, 2)])
def test_whole_prompt_cached_recomputes_last_token(llama, llm_factory, hf_ref, prompt_of, engine_clean,
                                                   length, hits):
    """Only blocks ending before the last prompt token are hits: that token is always computed."""
    llm = llm_factory(llama)
    bm = llm.engine.block_manager
    prompt = prompt_of(2200 + length, length)
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    before = bm.stats.hits
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert bm.stats.hits - before == hits
    assert _tokens(second) == _tokens(first) == [hf_ref(llama, prompt, MAX_NEW)]
    engine_clean(llm)


def test_n3_with_cached_prefix(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(llama)
    prompts = _shared(prompt_of, 2300, 35, (0, 6, 13))  # the first prompt is the prefix alone
    sp = SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW)
    llm.generate(prompts[0], sp, use_tqdm=False)
    warm = llm.generate(prompts, sp, use_tqdm=False)
    for p, o in zip(prompts, warm):
        assert _tokens(o) == [hf_ref(llama, p, MAX_NEW)] * 3
    assert llm.engine.block_manager.stats.hits >= 2 * len(prompts)
    engine_clean(llm)
    _all_unowned(llm)


def test_preemption_with_shared_prefix(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    """A KV cache of one max_model_len sequence: preempted sequences come back through the cache."""
    llm = llm_factory(llama, max_num_batched_tokens=16, kv_cache_memory=llama.kv_bytes_for(96))
    prompts = _shared(prompt_of, 2400, 33, (2, 10, 20, 7))
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(n=2, temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24), SamplingParams(n=3, temperature=0, max_tokens=24)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, sp, o in zip(prompts, params, outs):
        assert _tokens(o) == [hf_ref(llama, p, 24)] * sp.n
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.stats.hits > 0
    engine_clean(llm)
    _all_unowned(llm)


def test_eviction_keeps_outputs_exact(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(llama, kv_cache_memory=llama.kv_bytes_for(96))  # 6 blocks
    bm = llm.engine.block_manager
    prompts = [prompt_of(2500 + i, 40) for i in range(4)]
    for p in prompts + prompts[:1]:  # the first prompt's blocks are evicted before it comes back
        out = llm.generate(p, GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_ref(llama, p, MAX_NEW)
        engine_clean(llm)
    assert bm.stats.evictions > 0
    before = bm.stats.hits
    again = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]  # now cached again: hits
    assert bm.stats.hits > before
    assert again.outputs[0].token_ids == hf_ref(llama, prompts[0], MAX_NEW)
    engine_clean(llm)


def test_abort_request_sharing_cached_blocks(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(llama, max_num_batched_tokens=16)
    eng, bm = llm.engine, llm.engine.block_manager
    prompts = _shared(prompt_of, 2600, 40, (4, 8, 12))
    llm.generate(prompts[0], GREEDY, use_tqdm=False)
    long = SamplingParams(temperature=0, max_tokens=24)
    eng.add_request("a", None, prompts[1], long)
    eng.add_request("b", None, prompts[2], SamplingParams(n=2, temperature=0, max_tokens=24))
    last = {}
    for _ in range(4):
        for o in eng.step():
            last[o.request_id] = o
        eng.check_blocks()
    shared = eng.requests["a"].seqs[0].block_table[0]
    assert bm.ref_count(shared) >= 2  # a's first block is b's too (and cached from the warm-up)
    out = eng.abort("a")
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    eng.check_blocks()
    assert bm.ref_count(shared) >= 1 and bm.is_cached(shared)
    while eng.has_unfinished():
        for o in eng.step():
            last[o.request_id] = o
        eng.check_blocks()
    assert _tokens(last["b"]) == [hf_ref(llama, prompts[2], 24)] * 2
    engine_clean(llm)
    _all_unowned(llm)


def test_disabled_behaves_as_before(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(llama, enable_prefix_caching=False)
    bm = llm.engine.block_manager
    prompts = _shared(prompt_of, 2700, 37, (5, 9))
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_ref(llama, p, MAX_NEW)
        engine_clean(llm)
        assert bm.num_cached == 0 and not any(bm.is_cached(b) for b in range(bm.num_blocks))
    assert (bm.stats.queries, bm.stats.hits, bm.stats.evictions) == (0, 0, 0)


def test_kv_usage_waste_is_partial_last_blocks(llama, llm_factory, prompt_of):
    llm = llm_factory(llama)
    eng = llm.engine
    eng.add_request("a", None, prompt_of(2800, 20), SamplingParams(n=2, temperature=0, max_tokens=8))
    eng.add_request("b", None, prompt_of(2801, 37), SamplingParams(temperature=0, max_tokens=8))
    eng.step()
    u = eng.kv_usage()
    per_token, bs = llama.kv_bytes_per_token, 16
    running = eng.scheduler.running
    assert len(running) == 3  # a forked into two
    waste = sum(len(s.block_table) * bs - s.num_computed_tokens for s in running) * per_token
    assert u.waste_bytes == waste
    assert u.reserved_bytes == eng.plan.kv_cache_bytes
    assert u.owned_bytes == u.token_bytes + u.waste_bytes
    assert u.shared_saved_bytes == bs * per_token  # a's full first block is shared by its two forks
    assert u.owned_bytes + u.cached_bytes + u.free_bytes == u.reserved_bytes
    for rid in ("a", "b"):
        eng.abort(rid)


def test_flag_and_config():
    from strata.cli import build_parser
    from strata.engine.args import EngineArgs

    on = build_parser().parse_args(["generate", "--prompt", "x"])
    off = build_parser().parse_args(["generate", "--prompt", "x", "--no-prefix-caching"])
    assert EngineArgs.from_cli_args(on).create_engine_config().enable_prefix_caching is True
    assert EngineArgs.from_cli_args(off).create_engine_config().enable_prefix_caching is False
    from strata.config import EngineConfig

    assert EngineConfig().enable_prefix_caching is True
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")


# --- the scheduler over a fake KV store -------------------------------------------------------


class KVSim:
    """The engine's step around the real Scheduler; the 'forward' writes token ids into slots."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, max_len: int,
                 caching: bool = True) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, lifecycle=SequenceLifecycle(max_model_len=max_len))
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.max_len = max_len
        self.requests: dict[str, Request] = {}
        self.req_ids = itertools.count()

    def add(self, tokens: list[int], max_tokens: int, n: int) -> None:
        tokens = tokens[: self.max_len - 1] or [0]
        rid = str(next(self.req_ids))
        req = Request(rid, None, list(tokens), SamplingParams(n=n, max_tokens=max_tokens))
        self.requests[rid] = req
        self.sched.add_request(req)

    def abort(self, pick: int) -> None:
        if self.requests:
            self.sched.abort(self.requests.pop(sorted(self.requests)[pick % len(self.requests)]))

    def live(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if not s.finished]

    def step(self) -> None:
        bm, bs, sched = self.bm, self.bm.block_size, self.sched
        out = sched.schedule()
        for src, dst in out.block_copies:
            self.kv[dst] = list(self.kv[src])
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            table = seq.block_table
            for pos in range(start):  # what attention reads: exactly this sequence's tokens
                assert self.kv[table[pos // bs]][pos % bs] == seq.token_ids[pos], (seq, pos)
            for pos in range(start, start + s.num_tokens):
                b = table[pos // bs]
                assert bm.ref_count(b) == 1 and not bm.is_cached(b), "KV written into a shared block"
                self.kv[b][pos % bs] = seq.token_ids[pos]
        samplers = [x for s in out.scheduled if s.samples for x in (s.seq, *s.forks)]  # forks: parent's row
        # a small alphabet, so completions sometimes coincide
        tokens = [hash((seq.index, seq.num_tokens, seq.request.request_id)) % 3 for seq in samplers]
        sched.update(out, samplers, SamplerOutput(tokens, [None] * len(samplers)))
        for rid, req in list(self.requests.items()):
            if req.finished:
                del self.requests[rid]
        bm.check([s.block_table for s in self.live()])

    def drain(self) -> None:
        for _ in range(5000):
            if not self.requests:
                break
            self.step()
        assert not self.requests and not self.sched.has_work()
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


prefix_st = st.lists(st.integers(0, 2), min_size=4, max_size=24)
add_op = st.tuples(st.just("add"), st.integers(0, 2), st.lists(st.integers(0, 2), max_size=12),
                   st.integers(1, 16), st.sampled_from([1, 1, 2, 3]))
op_st = st.one_of(add_op, st.tuples(st.just("step")), st.tuples(st.just("step")),
                  st.tuples(st.just("abort"), st.integers(0, 50)))


@settings(max_examples=200)
@given(
    prefixes=st.lists(prefix_st, min_size=1, max_size=3),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 4),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    max_len=st.integers(6, 40),
    caching=st.sampled_from([True, True, False]),
    ops=st.lists(op_st, min_size=8, max_size=60),
)
def test_scheduler_reads_only_its_own_kv(prefixes, block_size, extra_blocks, max_num_seqs, budget, max_len,
                                         caching, ops):
    sim = KVSim(-(-max_len // block_size) + extra_blocks, block_size, max_num_seqs, budget, max_len, caching)
    for op in ops:
        if op[0] == "add":
            sim.add(prefixes[op[1] % len(prefixes)] + op[2], op[3], op[4])
        elif op[0] == "step":
            sim.step()
        else:
            sim.abort(op[1])
    sim.drain()
    stats = sim.bm.stats
    event(f"hits: {stats.hits > 0}")
    event(f"evictions: {stats.evictions > 0}")
    event(f"preempted: {sim.sched.num_preemptions > 0}")
