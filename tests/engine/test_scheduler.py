"""The real Scheduler driven with real Request/Sequence objects and no model.

A hypothesis test interleaves add / step / abort (with n > 1 forks as the engine does them),
checks the token budget, max_num_seqs, block ownership and status invariants after every step,
then drains the queue and checks that everything finishes with every block free.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from strata.engine.lifecycle import SequenceLifecycle
from strata.engine.request import Request, SeqStatus, Sequence
from strata.engine.sampler import SamplerOutput
from strata.engine.scheduler import Scheduler
from strata.memory.blocks import BlockManager
from strata.platform.policy import StepPolicy
from strata.protocol.sampling_params import SamplingParams


class Sim:
    """The engine's step around the real scheduler (schedule -> fake forward -> fake sample ->
    update), with a fake token instead of a model."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int, max_len: int,
                 decode_first: int | None = None):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, lifecycle=SequenceLifecycle(max_model_len=max_len),
                               policy=StepPolicy(prefill_cap=decode_first))
        self.max_len = max_len
        self.requests: dict[str, Request] = {}
        self.req_ids = itertools.count()
        self.forked_any = False
        self.steps = 0

    def add(self, prompt_len: int, max_tokens: int, n: int) -> None:
        prompt_len = min(prompt_len, self.max_len - 1)
        rid = str(next(self.req_ids))
        req = Request(rid, None, list(range(3, 3 + prompt_len)), SamplingParams(n=n, max_tokens=max_tokens))
        self.requests[rid] = req
        self.sched.add_request(req)

    def abort(self, pick: int) -> None:
        if not self.requests:
            return
        rid = sorted(self.requests)[pick % len(self.requests)]
        self.sched.abort(self.requests.pop(rid))

    def live_seqs(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if not s.finished]

    def check(self) -> None:
        sched = self.sched
        running_ids = [s.seq_id for s in sched.running]
        waiting_ids = [s.seq_id for s in sched.waiting]
        assert len(set(running_ids)) == len(running_ids)
        assert len(set(waiting_ids)) == len(waiting_ids)
        assert not set(running_ids) & set(waiting_ids)
        live = self.live_seqs()
        assert {s.seq_id for s in live} == set(running_ids) | set(waiting_ids)
        for s in sched.running:
            assert s.status is SeqStatus.RUNNING
            assert len(s.block_table) * self.bm.block_size >= s.num_computed_tokens
        for s in sched.waiting:
            assert s.status is SeqStatus.WAITING
            if s.num_computed_tokens == 0:
                assert not s.block_table
        self.bm.check([s.block_table for s in live])
        if not self.forked_any:
            assert len(sched.running) <= sched.max_num_seqs

    def step(self):
        sched = self.sched
        out = sched.schedule()
        self.steps += 1
        assert out.num_tokens <= sched.max_num_batched_tokens
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(set(ids)) == len(ids), "a sequence scheduled twice in one step"
        preempted = {s.seq_id for s in out.preempted}
        assert not preempted & set(ids), "a preempted sequence was also scheduled"
        for s in out.preempted:
            assert s.status is SeqStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
            assert s in sched.waiting
        for s in out.scheduled:
            seq = s.seq
            assert s.num_tokens >= 1
            assert seq.num_computed_tokens + s.num_tokens <= seq.num_tokens
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + s.num_tokens
            assert seq.status is SeqStatus.RUNNING and seq in sched.running
        if not self.forked_any:
            assert len(sched.running) <= sched.max_num_seqs
        # the block manager agrees with the tables before the step's (fake) forward
        self.bm.check([s.block_table for s in self.live_seqs()])
        for s in out.scheduled:  # a request with n > 1 forks when its prompt is first computed
            assert not s.forks or (s.samples and len(s.forks) == s.seq.request.params.n - 1)
            self.forked_any |= bool(s.forks)
        # the rows the runner returns: each sampling sequence, forks sampling from their parent's row
        samplers = [x for s in out.scheduled if s.samples for x in (s.seq, *s.forks)]
        sched.update(out, samplers, SamplerOutput([7] * len(samplers), [None] * len(samplers)))
        for seq in samplers:  # the scheduler applied the stop conditions and freed what finished
            p = seq.request.params
            assert seq.finished == (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_len)
        for rid, req in list(self.requests.items()):
            if req.finished:
                del self.requests[rid]
        self.check()
        return out

    def drain(self, limit: int = 5000) -> None:
        while self.requests:
            assert self.steps < limit, "scheduler made no progress (livelock or deadlock)"
            self.step()
        assert not self.sched.has_work()
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks


add_op = st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 30), st.sampled_from([1, 1, 1, 2, 3]))
ops = st.lists(
    st.one_of(
        add_op,
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=200)
@given(
    initial=st.lists(add_op, max_size=6),
    block_size=st.sampled_from([1, 4, 16]),
    extra_blocks=st.integers(0, 3),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    max_len=st.integers(8, 64),
    ops=ops,
)
def test_scheduler_random_ops(initial, block_size, extra_blocks, max_num_seqs, budget, max_len, ops):
    # as the engine guarantees: at least one max_model_len sequence fits
    num_blocks = -(-max_len // block_size) + extra_blocks
    sim = Sim(num_blocks, block_size, max_num_seqs, budget, max_len)
    for op in initial + ops:
        if op[0] == "add":
            sim.add(*op[1:])
        elif op[0] == "step":
            sim.step()
        else:
            sim.abort(op[1])
        sim.check()
    sim.drain()
    event(f"preempted: {sim.sched.num_preemptions > 0}")
    event(f"forked: {sim.forked_any}")


# --- deterministic behaviour -----------------------------------------------------------------


def _seq(sim: Sim, prompt_len: int, max_tokens: int = 4) -> Sequence:
    sim.add(prompt_len, max_tokens, 1)
    return sim.requests[str(next(iter(reversed(sim.requests))))].seqs[0]


def test_budget_split_decode_first_then_chunks():
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, budget=10, max_len=64)
    a = _seq(sim, 3)
    sim.step()  # a: prefill 3, samples
    b = _seq(sim, 25)
    out = sim.step()
    assert [(s.seq, s.num_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    sim.drain()


def test_fcfs_head_of_queue_blocks_later_requests():
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=8, budget=64, max_len=16)
    big = _seq(sim, 14, max_tokens=2)
    sim.step()
    assert len(big.block_table) == 4
    waiting_big = _seq(sim, 15, max_tokens=1)
    small = _seq(sim, 1, max_tokens=1)
    out = sim.step()
    # big holds all 4 blocks; the small request must not overtake the head of the queue
    assert [s.seq for s in out.scheduled] == [big]
    assert list(sim.sched.waiting) == [waiting_big, small]
    out = sim.step()  # big finished and freed its blocks: the head goes first
    assert [s.seq for s in out.scheduled][0] is waiting_big
    sim.drain()


def test_preemption_is_recompute_of_most_recent():
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=8, budget=64, max_len=16)
    a = _seq(sim, 4, max_tokens=10)
    b = _seq(sim, 4, max_tokens=10)
    c = _seq(sim, 4, max_tokens=10)
    sim.step()  # all three prefilled (3 blocks), one token each
    sim.step()  # decodes need a 2nd block each: 4th block to a, then b preempts c
    assert sim.sched.num_preemptions >= 1
    assert c.status is SeqStatus.WAITING and c.num_computed_tokens == 0 and not c.block_table
    assert c.num_preemptions >= 1 and sim.sched.waiting[0] is c
    assert a.status is SeqStatus.RUNNING
    sim.drain()
    assert all(s.num_output_tokens == 10 for s in (a, b, c))


def test_finish_frees_from_either_queue():
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=1, budget=64, max_len=32)
    a = _seq(sim, 5)
    b = _seq(sim, 5)
    sim.step()
    assert a.block_table and not b.block_table and b in sim.sched.waiting
    sim.sched.finish(b)
    sim.sched.finish(a)
    assert not sim.sched.has_work()
    assert sim.bm.num_free == 8


@pytest.mark.parametrize("prompt_len", [4, 6])
def test_fork_shares_prompt_blocks(prompt_len):
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=8, budget=64, max_len=32)
    sim.add(prompt_len, 3, 3)
    sim.step()
    req = next(iter(sim.requests.values()))
    assert len(req.seqs) == 3
    parent = req.seqs[0]
    for child in req.seqs[1:]:
        assert child.block_table[0] == parent.block_table[0]  # the full first block is shared
        assert child.num_computed_tokens == prompt_len
    out = sim.step()  # the partial last block is copied before the children's first decode
    assert len(out.block_copies) == (2 if prompt_len % 4 else 0)
    for src, dst in out.block_copies:
        assert src == parent.block_table[-1] or src in parent.block_table
        assert any(dst in c.block_table for c in req.seqs[1:])
    sim.drain()


def test_decode_first_caps_prefill_while_streams_decode():
    """While a sequence decodes, a long prompt is prefilled cap tokens a step and the decode runs
    every step; with nothing decoding the prompt takes the whole budget; everything finishes."""
    sim = Sim(num_blocks=64, block_size=8, max_num_seqs=8, budget=256, max_len=400, decode_first=32)
    sim.add(prompt_len=5, max_tokens=40, n=1)
    first = sim.step()
    assert first.num_tokens == 5  # nobody decodes yet: no cap
    decoder = first.scheduled[0].seq
    sim.add(prompt_len=200, max_tokens=3, n=1)
    for _ in range(6):
        out = sim.step()
        by_seq = {s.seq.seq_id: s.num_tokens for s in out.scheduled}
        assert by_seq[decoder.seq_id] == 1  # the running stream is never frozen
        prefill = sum(n for sid, n in by_seq.items() if sid != decoder.seq_id)
        assert prefill == 32
    sim.drain()

    alone = Sim(num_blocks=64, block_size=8, max_num_seqs=8, budget=256, max_len=400, decode_first=32)
    alone.add(prompt_len=200, max_tokens=3, n=1)
    assert alone.step().num_tokens == 200
    alone.drain()


@settings(max_examples=40, deadline=None)
@given(st.lists(add_op, min_size=1, max_size=12), st.sampled_from([1, 7, 16]))
def test_decode_first_makes_progress(adds, cap):
    sim = Sim(num_blocks=24, block_size=4, max_num_seqs=4, budget=48, max_len=64, decode_first=cap)
    for _, prompt_len, max_tokens, n in adds:
        sim.add(prompt_len, max_tokens, n)
        sim.step()
    sim.drain()
