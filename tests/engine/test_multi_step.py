"""Multi-step decode (platform/multi_step.py): several decode steps per scheduler call give exactly
the outputs of one step per call (greedy, seeded and unseeded sampling, logprobs, penalties, stop
tokens, max_tokens and max_model_len), in every family and weight format; the scheduler runs them
only when every sequence is a plain decode, nobody waits and the blocks are there; the automatic
count follows the measured step time."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import FAMILIES, assert_engine_clean, make_llm

from strata import SamplingParams
from strata.engine.lifecycle import SequenceLifecycle
from strata.engine.request import Request
from strata.engine.scheduler import Scheduler
from strata.errors import ConfigError
from strata.memory.blocks import BlockManager
from strata.platform import multi_step
from strata.platform.cpu_decode_step import EmbeddingLookup
from strata.platform.policy import StepPolicy

LENGTHS = (3, 11, 26, 80)  # the last reaches max_model_len (96) before its max_tokens


def _generate(model, prompts, params, **kw):
    """(per prompt: tokens, finish reason, logprobs), the steps each scheduler call ran, and how
    many steps continued the fused CPU step (ModelRunner.execute_next -> the decode step's next)."""
    llm = make_llm(model, **kw)
    try:
        eng = llm.engine
        runs, fused = [], []
        eng.step_observers.append(lambda e: runs.append(e.last_schedule.num_steps))
        step = eng.runner.decode_step
        if step is not None:
            decode_next = step.next

            def counting(*args):
                hidden = decode_next(*args)
                fused.append(hidden is not None)
                return hidden
            step.next = counting
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_engine_clean(llm)
        got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]
        return got, runs, sum(fused)
    finally:
        llm.close()


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_one_step_per_call(tiny_models, family):
    model = tiny_models[family]
    prompts = _prompts(model.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 9, 17, 30)]
    want, runs1, _ = _generate(model, prompts, params, num_scheduler_steps=1)
    got, runs, fused = _generate(model, prompts, params, num_scheduler_steps=4)
    assert got == want
    assert set(runs1) == {1} and max(runs) == 4  # it did run several steps per call
    assert want[3][1] == "length" and len(want[3][0]) == 96 - LENGTHS[3]  # max_model_len bounded it
    assert fused > 0  # every family here runs the fused step (Qwen3's q/k norms included)


def test_sampling_logprobs_penalties_and_stops_equal(llama):
    prompts = _prompts(llama.vocab_size)
    stop = prompts[1][-1]  # a token this model is likely to produce again
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=20, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=24, repetition_penalty=1.3, stop_token_ids=[stop],
                       min_tokens=3),  # the engine's own generator (no seed)
        SamplingParams(temperature=0, max_tokens=18, presence_penalty=0.5, frequency_penalty=0.3, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=7, max_tokens=12),
    ]
    want, _, _ = _generate(llama, prompts, params, num_scheduler_steps=1)
    got, runs, _ = _generate(llama, prompts, params, num_scheduler_steps=6)
    assert got == want and max(runs) > 1


@pytest.mark.parametrize("quantization", ["int8", "int4", "bf16"])
def test_quantized_weights_equal(tiny_models, quantization):
    model = tiny_models["qwen2"]
    prompts = _prompts(model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    want, _, _ = _generate(model, prompts, params, num_scheduler_steps=1, quantization=quantization)
    got, _, fused = _generate(model, prompts, params, num_scheduler_steps=5, quantization=quantization)
    assert got == want and fused > 0


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_embedding_lookup_equals_the_module(tiny_models, family, quantization):
    """The fused step's numpy embedding lookup (cpu_decode_step.EmbeddingLookup) gives the module's rows exactly,
    for the plain, bf16-widened and quantised tied embeddings."""
    llm = make_llm(tiny_models[family], quantization=quantization)
    try:
        embed = llm.engine.model.embed_tokens
        ids = np.array([0, 5, 17, tiny_models[family].vocab_size - 1, 5], np.int64)
        got = EmbeddingLookup(embed)(ids)
        with torch.inference_mode():
            want = embed(torch.from_numpy(ids)).numpy()
        assert got.dtype == np.float32 and np.array_equal(got, want)
    finally:
        llm.close()


def _scheduler(num_blocks=64, lookahead=4, max_len=1000):
    sched = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=8, max_num_batched_tokens=256,
                      lifecycle=SequenceLifecycle(max_model_len=max_len), policy=StepPolicy(lookahead=lookahead))
    return sched


def _decoding(sched, prompt_len=6, max_tokens=100, count=2):
    """Requests admitted and prefilled (one sampled token each): the next call only decodes."""
    for i in range(count):
        sched.add_request(Request(str(i), None, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens)))
    out = sched.schedule()
    seqs = [s.seq for s in out.scheduled]
    sched.update(out, seqs, SimpleNamespace(token_ids=[9] * len(seqs), logprobs=[None] * len(seqs)))
    return seqs


def test_scheduler_reserves_blocks_for_the_steps():
    sched = _scheduler()
    seqs = _decoding(sched)
    out = sched.schedule()
    assert out.num_steps == 4
    for seq in seqs:  # prompt 6 + 1 sampled; 4 steps write positions 6..9: 10 tokens, 3 blocks of 4
        assert len(seq.block_table) == 3


@pytest.mark.parametrize("case", ["waiting", "max_tokens", "max_model_len", "no_blocks", "lookahead_1"])
def test_scheduler_runs_one_step_when_it_must(case):
    sched = _scheduler(num_blocks={"no_blocks": 4}.get(case, 64), lookahead={"lookahead_1": 1}.get(case, 4),
                       max_len={"max_model_len": 9}.get(case, 1000))
    _decoding(sched, max_tokens={"max_tokens": 3}.get(case, 100))
    if case == "waiting":
        sched.add_request(Request("late", None, [3, 4, 5], SamplingParams()))
        sched.max_num_seqs = 2  # it cannot be admitted: it waits
    out = sched.schedule()
    want = {"max_tokens": 2, "max_model_len": 3}.get(case, 1)  # 1 output so far of 3; 7 tokens of 9
    assert out.num_steps == want


def test_auto_steps_follow_the_measured_step_time():
    sched = StepPolicy()  # what the scheduler reads
    tuner = multi_step.AutoSteps(sched)
    eng = SimpleNamespace(stage_seconds={"schedule": 0.0, "forward": 0.0, "sample": 0.0}, last_schedule=None)

    def step(seconds, steps=1, prompt=False):
        eng.stage_seconds["forward"] += seconds
        scheduled = [SimpleNamespace(num_tokens=5 if prompt else 1)]
        eng.last_schedule = SimpleNamespace(scheduled=scheduled, num_tokens=sum(s.num_tokens for s in scheduled),
                                            num_steps=steps)
        tuner(eng)

    step(0.008)  # the first call only starts the clock
    for _ in range(20):
        step(0.008)
    assert sched.lookahead == 6  # 50 ms / 8 ms
    for _ in range(20):
        step(0.020 * 2, steps=2)  # per step 20 ms, whatever the steps per call
    assert sched.lookahead == 2
    step(1.0, prompt=True)  # a prefill step says nothing about decode
    assert sched.lookahead == 2
    for _ in range(20):
        step(0.001)
    assert sched.lookahead == multi_step.MAX_STEPS


def test_auto_only_where_it_applies(llama):
    for kw, on in (({}, True), ({"num_scheduler_steps": 3}, False), ({"speculative_model": "ngram"}, False)):
        llm = make_llm(llama, **kw)
        try:
            tuners = [o for o in llm.engine.policy.tuners if isinstance(o, multi_step.AutoSteps)]
            assert bool(tuners) == on
            assert llm.engine.scheduler.policy.lookahead == kw.get("num_scheduler_steps", 1)
        finally:
            llm.close()


@pytest.mark.parametrize("kw, match", [
    ({"num_scheduler_steps": 0}, "num_scheduler_steps: must be a positive integer"),
    ({"num_scheduler_steps": 2.5}, "num_scheduler_steps: must be a positive integer"),
    ({"num_scheduler_steps": 4, "tensor_parallel_size": 2}, "not implemented with tensor parallelism"),
    ({"num_scheduler_steps": 4, "speculative_model": "ngram"}, "speculative decoding do not combine"),
])
def test_bad_settings_are_refused(kw, match):
    from strata.config import EngineConfig

    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kw)


def test_advance_rows_matches_its_numpy_twin():
    """cpu_decode_layer.advance_rows (compiled) against the arithmetic it replaces, across block
    boundaries and row counts 1..16."""
    from strata.kernels import cpu_decode_layer

    rng = np.random.default_rng(0)
    for rows in (1, 3, 16):
        tables = rng.integers(0, 1000, (rows, 9)).astype(np.int64)
        pos = rng.integers(0, 8 * 16 - 1, rows).astype(np.int64)
        pos[0] = 15  # the next position opens a new block
        want = pos + 1
        slots, lens = np.empty_like(pos), np.empty_like(pos)
        cpu_decode_layer.advance_rows(pos, tables, 16, slots, lens)
        assert np.array_equal(pos, want) and np.array_equal(lens, want + 1)
        assert np.array_equal(slots, tables[np.arange(rows), want // 16] * 16 + want % 16)


def test_fused_embedding_lookup_follows_a_replaced_weight(llama):
    llm = make_llm(llama)
    try:
        embed = llm.engine.model.embed_tokens
        ids = np.array([3, 9], np.int64)
        lookup = EmbeddingLookup(embed)
        lookup(ids)
        embed.weight = torch.nn.Parameter(embed.weight.detach() * 2, requires_grad=False)
        assert np.array_equal(lookup(ids), embed.weight.detach().numpy()[ids])
    finally:
        llm.close()


def test_the_flag_help_states_the_cap():
    from strata.engine.args import FLAGS

    flag = next(f for f in FLAGS if f.field == "num_scheduler_steps")
    assert f"at most {multi_step.MAX_STEPS};" in flag.default_text
