"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p sets, penalties, min_tokens, logprobs.

Unit tests use synthetic logits and real Request/Sequence objects; end-to-end tests go through
LLM.generate on a tiny checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from strata import SamplingParams
from strata.engine.request import Request, Sequence
from strata.engine.sampler import Sampler, _mask_by_sort, apply_min_p, apply_top_k_top_p, draw

EOS = 2


def make_seq(params: SamplingParams, prompt=(5, 6, 7), output=(), index: int = 0, seq_id: int = 0) -> Sequence:
    req = Request(f"r{seq_id}", None, list(prompt), params)
    seq = Sequence(seq_id, req, index, list(prompt) + list(output))
    req.seqs.append(seq)
    return seq


def sample(logits: torch.Tensor, params: SamplingParams | list[SamplingParams], seed: int = 0, **kw):
    rows = logits.shape[0]
    plist = params if isinstance(params, list) else [params] * rows
    seqs = [make_seq(p, seq_id=i, **kw) for i, p in enumerate(plist)]
    return Sampler(logits.shape[-1], [EOS], seed)(logits, seqs)


def _logits_from_probs(probs: list[float], vocab: int) -> torch.Tensor:
    rest = (1.0 - sum(probs)) / (vocab - len(probs))
    p = torch.tensor(probs + [rest] * (vocab - len(probs)), dtype=torch.float64)
    return p.log().float()


# --- greedy and seeds --------------------------------------------------------------------------


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g) * 3
    out = sample(logits, SamplingParams(temperature=0))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_unaffected_by_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    out = sample(logits, params)
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_seeded_row_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 64, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(row, seeded, seed=s).token_ids[0] for s in range(3)]
    assert len(set(alone)) == 1  # the engine seed does not matter for a seeded request
    for others in (1, 5):
        logits = torch.cat([torch.randn(others, 64, generator=g), row])
        params = [SamplingParams(temperature=1.0)] * others + [seeded]
        assert sample(logits, params, seed=99).token_ids[-1] == alone[0]


def test_seeded_draws_follow_the_distribution():
    """Each row is a sample from p: check frequencies over many rows."""
    probs = [0.5, 0.3, 0.2]
    logits = torch.tensor(probs).log().expand(6000, 3).contiguous()
    out = sample(logits, SamplingParams(temperature=1.0))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 6000
    assert torch.allclose(counts, torch.tensor(probs), atol=0.03), counts


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4).contiguous()
    hot = torch.tensor(sample(logits, SamplingParams(temperature=2.0)).token_ids)
    cold = torch.tensor(sample(logits, SamplingParams(temperature=0.25)).token_ids)
    assert (cold == 0).float().mean() > 0.95
    assert (hot == 0).float().mean() < 0.6


# --- allowed sets ------------------------------------------------------------------------------


def _drawn(logits_row: torch.Tensor, params: SamplingParams, rows: int = 3000) -> set[int]:
    return set(sample(logits_row.expand(rows, -1).contiguous(), params).token_ids)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_top_k_never_leaves_top_k(temperature):
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1, 80, generator=g)
    allowed = set(row[0].topk(5).indices.tolist())
    drawn = _drawn(row, SamplingParams(temperature=temperature, top_k=5))
    assert drawn <= allowed
    assert len(drawn) >= 3  # it does sample, not pick one


def test_top_p_never_leaves_nucleus():
    row = _logits_from_probs([0.5, 0.25, 0.15], 40)[None]
    drawn = _drawn(row, SamplingParams(temperature=1.0, top_p=0.7))
    assert drawn == {0, 1}  # 0.5 < 0.7 needs the 0.25 too; 0.75 >= 0.7 stops there
    assert _drawn(row, SamplingParams(temperature=1.0, top_p=0.4)) == {0}


def test_min_p_never_leaves_threshold():
    row = _logits_from_probs([0.5, 0.25, 0.15], 40)[None]
    drawn = _drawn(row, SamplingParams(temperature=1.0, min_p=0.25))  # threshold 0.125
    assert drawn == {0, 1, 2}


def test_top_k_top_p_min_p_combined():
    row = _logits_from_probs([0.3, 0.25, 0.2, 0.15], 40)[None]
    drawn = _drawn(row, SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.5))
    # top-3 renormalised: .4, .33, .27 -> top_p .9 keeps 3; min_p .5 of .4 -> keeps 0, 1, 2
    assert drawn <= {0, 1, 2} and 0 in drawn


def _reference_top_k_top_p(row: torch.Tensor, k: int, p: float) -> tuple[set[int], float]:
    """Allowed ids, and how close the decision came to the top_p boundary (for assume())."""
    order = row.double().argsort(descending=True).tolist()
    if k > 0:
        order = order[:k]
    probs = row.double()[order].softmax(-1)
    allowed, mass, margin = set(), 0.0, math.inf
    for tok, q in zip(order, probs.tolist()):
        if allowed:
            margin = min(margin, abs(mass - p))
        if allowed and mass >= p:
            break
        allowed.add(tok)
        mass += q
    return allowed, margin


@settings(max_examples=150)
@given(
    seed=st.integers(0, 10_000),
    vocab=st.integers(2, 60),
    top_k=st.one_of(st.just(-1), st.integers(1, 70)),
    top_p=st.floats(0.01, 1.0),
    scale=st.sampled_from([0.1, 1.0, 5.0]),
    candidates=st.sampled_from([1, 3, 1024]),  # small: the top-candidates path on small vocabularies
)
def test_apply_top_k_top_p_matches_reference(seed, vocab, top_k, top_p, scale, candidates):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, vocab, generator=g) * scale
    out = apply_top_k_top_p(logits, torch.tensor([top_k, -1]), torch.tensor([top_p, 1.0]), candidates)
    assert torch.equal(out[1], logits[1])  # the row asking for neither keeps every token
    allowed, margin = _reference_top_k_top_p(logits[0], top_k, top_p)
    assume(margin > 1e-4)
    kept = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert kept == allowed
    assert torch.equal(out[0][list(kept)], logits[0][list(kept)])
    assert int(logits[0].argmax()) in kept


def test_top_p_one_means_disabled_in_a_mixed_batch():
    """top_p=1 (off) must not mask anything, even next to a row that uses top_p < 1.

    With spread-out logits the float32 cumsum reaches 1.0 before the last tokens, so
    `before >= top_p` with top_p=1.0 masks the tail of a row that asked for no top-p at all.
    """
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 12, generator=g) * 5
    out = apply_top_k_top_p(logits, torch.tensor([-1, -1]), torch.tensor([0.5, 1.0]))
    assert torch.equal(out[1], logits[1])
    out = apply_top_k_top_p(logits, torch.tensor([-1, 6]), torch.tensor([0.5, 1.0]))
    top6 = logits[1].topk(6).indices
    assert torch.isfinite(out[1]).sum() == 6 and torch.equal(out[1][top6], logits[1][top6])


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat rows reach past the candidates, peaked do not
def test_top_candidates_give_the_full_sorts_sets_on_a_large_vocabulary(scale):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50_000, generator=g) * scale
    top_k = torch.tensor([-1, -1, 40, 2000, -1, 7])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.8, 1.0, 1.0])
    fast = apply_top_k_top_p(logits, top_k, top_p)
    full = _mask_by_sort(logits, torch.where(top_k > 0, top_k, 50_000), top_p)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(full))
    assert torch.equal(fast[torch.isfinite(fast)], logits[torch.isfinite(fast)])
    assert torch.equal(fast[4], logits[4])  # top_k and top_p off


def test_draw_follows_the_probabilities_and_never_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    u = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000  # evenly spread uniforms
    drawn = draw(probs.expand(10_000, -1), u)
    counts = torch.bincount(drawn, minlength=6).double() / 10_000
    assert torch.allclose(counts, probs.double(), atol=1e-3), counts
    # unnormalised rows, and u at the ends of [0, 1): the first and the last live token
    row = torch.tensor([[0.0, 2.0, 0.0, 3.0, 0.0]])
    assert draw(row, torch.tensor([0.0], dtype=torch.float64)).item() == 1
    assert draw(row, torch.tensor([1.0 - 2**-53], dtype=torch.float64)).item() == 3


@pytest.mark.parametrize("vocab", [1000, 1024, 1031])  # blocks of 16: whole, and a short last block
def test_two_level_draw_matches_the_one_level_draw(vocab):
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(1, vocab, generator=g) ** 8  # uneven, with runs of near-zero tokens
    probs[0, torch.randperm(vocab, generator=g)[: vocab // 3]] = 0.0  # a third can never be drawn
    probs[0, -1] = 0.05  # the last token, in the short block when there is one, is drawable
    u = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000
    rows = probs.expand(4000, -1)
    two, one = draw(rows, u, block=16), draw(rows, u, block=vocab)
    assert (two == one).float().mean() > 0.999  # only a u within rounding of a boundary may differ
    assert bool((probs[0, two] > 0).all())
    assert draw(rows[:1], torch.tensor([1.0 - 2**-53], dtype=torch.float64), block=16).item() == vocab - 1


@settings(max_examples=100)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 60), min_p=st.floats(0.0, 1.0))
def test_apply_min_p_matches_reference(seed, vocab, min_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=g) * 2
    probs = logits.double().softmax(-1)[0]
    threshold = probs.max() * min_p
    assume(((probs - threshold).abs() > 1e-6).all())
    out = apply_min_p(logits, torch.tensor([min_p]))
    kept = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    assert kept == set((probs >= threshold).nonzero().flatten().tolist())
    assert int(logits.argmax()) in kept


# --- penalties ---------------------------------------------------------------------------------


def test_penalties_as_defined():
    vocab = 12
    logits = torch.linspace(-3, 3, vocab)[None]
    prompt, output = [1, 2, 3], [3, 4, 4, 11]
    params = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    seq = make_seq(params, prompt=prompt, output=output)
    got = Sampler(vocab, [EOS])._penalties(logits.clone(), [seq])[0]
    want = logits[0].clone()
    for t in set(prompt) | set(output):  # repetition: prompt and output, divide if > 0 else multiply
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    for t in set(output):  # presence/frequency: output tokens only
        want[t] -= 0.5 + 0.25 * output.count(t)
    torch.testing.assert_close(got, want)


def test_penalties_are_per_row_and_off_by_default():
    logits = torch.randn(2, 10)
    a = make_seq(SamplingParams(frequency_penalty=1.0), output=[4], seq_id=0)
    b = make_seq(SamplingParams(), output=[4], seq_id=1)
    got = Sampler(10, [EOS])._penalties(logits.clone(), [a, b])
    assert torch.equal(got[1], logits[1])
    assert got[0][4] == logits[0][4] - 1.0
    assert Sampler(10, [EOS])._penalties(logits, [b, b]) is logits


def test_frequency_penalty_changes_greedy_choice():
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 1.0, 0.6
    plain = sample(logits, SamplingParams(temperature=0), output=[4, 4])
    assert plain.token_ids == [4]
    penalised = sample(logits, SamplingParams(temperature=0, frequency_penalty=0.3), output=[4, 4])
    assert penalised.token_ids == [6]
    rep = sample(logits, SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[4], output=[])
    assert rep.token_ids == [6]


# --- min_tokens ---------------------------------------------------------------------------------


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7], logits[0, 5] = 5.0, 4.0, 1.0
    early = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7])
    assert sample(logits, early, output=[9]).token_ids == [5]
    assert sample(logits, early, output=[9, 9, 9]).token_ids == [EOS]
    no_eos = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    assert sample(logits, no_eos, output=[]).token_ids == [EOS]  # ignore_eos: EOS is an ordinary token


@pytest.fixture
def eos_is_first_greedy(llama, tmp_path, hf_ref, prompt_of):
    """A copy of the llama checkpoint whose EOS is the first token it greedily generates."""
    prompt = prompt_of(2000, 12)
    first = hf_ref(llama, prompt, 1, stop_at_eos=False)[0]
    dst = tmp_path / "eos_model"
    dst.mkdir()
    (dst / "model.safetensors").symlink_to(llama.path / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((llama.path / name).read_text())
        cfg["eos_token_id"] = first
        (dst / name).write_text(json.dumps(cfg))
    return dst, prompt, first


def test_min_tokens_end_to_end(llama, eos_is_first_greedy, llm_factory, hf_forward, engine_clean):
    path, prompt, eos = eos_is_first_greedy
    llm = llm_factory(path)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=4),
                       use_tqdm=False)[0].outputs[0]
    ids, ref = list(prompt), []
    for step in range(10):  # reference: EOS masked for the first 4 outputs, then stop on it
        logits = hf_forward(llama, ids)[-1]
        if step < 4:
            logits[eos] = -math.inf
        tok = int(logits.argmax())
        ref.append(tok)
        ids.append(tok)
        if tok == eos:
            break
    assert out.token_ids == ref
    assert eos not in out.token_ids[:4] and len(out.token_ids) >= 4
    engine_clean(llm)


# --- logprobs ----------------------------------------------------------------------------------


def test_logprobs_top_n_with_chosen_token(llama, llm_factory, hf_forward, prompt_of):
    llm = llm_factory(llama)
    prompt = prompt_of(2100, 9)
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = hf_forward(llama, prompt + out.token_ids).log_softmax(-1)
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top3 = row.topk(3).indices.tolist()
        assert tok in d
        assert set(d) == set(top3) | {tok}
        for t, lp in d.items():
            assert lp <= 0
            assert abs(lp - float(row[t])) < 1e-4

    zero = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=0),
                        use_tqdm=False)[0].outputs[0]
    assert [list(d) for d in zero.logprobs] == [[t] for t in zero.token_ids]
    none = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert none.outputs[0].logprobs is None


# --- seeded sampling end to end ----------------------------------------------------------------


def test_seeded_generation_same_across_runs_and_batches(llama, llm_factory, prompt_of, engine_clean):
    prompt = prompt_of(2200, 14)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    llm = llm_factory(llama)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again

    others = [prompt_of(2201, 30), prompt_of(2202, 5), prompt_of(2203, 50)]
    mixed = [SamplingParams(temperature=1.0, max_tokens=16),
             SamplingParams(temperature=0.8, seed=1, max_tokens=16),
             SamplingParams(temperature=0, max_tokens=16)]
    outs = llm.generate([others[0], prompt, others[1], others[2]],
                        [mixed[0], seeded, mixed[1], mixed[2]], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    engine_clean(llm)

    # a fresh engine with another engine seed, a tiny budget and preemption: still the same
    tight = llm_factory(llama, seed=5, max_num_batched_tokens=8, kv_cache_memory=llama.kv_bytes_for(96))
    outs = tight.generate([others[2], others[0], prompt], [mixed[0], mixed[2], seeded], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    engine_clean(tight)

    different = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone


def test_unseeded_generation_reproducible_per_engine_seed(llama, llm_factory, prompt_of):
    prompt = prompt_of(2300, 10)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = llm_factory(llama, seed=3).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm_factory(llama, seed=3).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
