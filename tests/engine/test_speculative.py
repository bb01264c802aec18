"""Speculative decoding (engine/speculative.py): greedy tokens exactly plain decoding's, for every
family, batched and with preemption; seeded sampling the same tokens too; the acceptance rule
keeps the target distribution (chi-square); rejected drafts' blocks are returned."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, make_llm

from strata import SamplingParams
from strata.engine.speculative import NgramProposer, rejection_sample


def _repetitive(seed: int, vocab: int, period: int = 7, length: int = 40) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    unit = torch.randint(3, vocab, (period,), generator=g).tolist()
    return (unit * (length // period + 1))[:length]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [_repetitive(1, vocab), _repetitive(2, vocab, period=3), torch.randint(3, vocab, (20,), generator=g).tolist(),
            _repetitive(3, vocab, period=5, length=12)]


def _run(model, prompts, params, **kw):
    llm = make_llm(model, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        spec = llm.engine.scheduler.speculator
        stats = None if spec is None else spec.stats
        eng = llm.engine
        assert not eng.has_unfinished() and eng.block_manager.num_free == eng.block_manager.num_blocks
        return [o.outputs[0].token_ids for o in outs], stats, sum(o.num_preemptions for o in outs)
    finally:
        llm.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_plain_decoding(tiny_models, family):
    model = tiny_models[family]
    prompts = _prompts(model.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _, _ = _run(model, prompts, params)
    for k in (1, 4):
        spec, stats, _ = _run(model, prompts, params, speculative_model="ngram", num_speculative_tokens=k)
        assert spec == plain
        assert stats.drafted > 0 and stats.accepted > 0  # drafts were proposed and some kept


def test_greedy_equal_with_preemption(tiny_models):
    model = tiny_models["llama"]
    prompts = _prompts(model.vocab_size) * 3
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    small = dict(kv_cache_memory=model.kv_bytes_for(200), max_num_seqs=12)
    plain, _, _ = _run(model, prompts, params, **small)
    spec, stats, preempted = _run(model, prompts, params, speculative_model="ngram", **small)
    assert preempted > 0 and stats.accepted > 0
    assert spec == plain


def test_seeded_sampling_gives_the_same_tokens(tiny_models):
    """Row i of a draft samples with the noise plain decoding would use at that position."""
    model = tiny_models["qwen2"]
    prompts = _prompts(model.vocab_size)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=s, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.1, min_tokens=5) for s in range(len(prompts))]
    plain, _, _ = _run(model, prompts, params)
    spec, stats, _ = _run(model, prompts, params, speculative_model="ngram")
    assert spec == plain and stats.drafted > 0


def test_stops_inside_an_accepted_draft(tiny_models):
    model = tiny_models["mistral"]
    prompts = _prompts(model.vocab_size)
    plain_p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _, _ = _run(model, prompts, plain_p)
    stop = [plain[0][9], plain[1][7]]  # tokens the outputs reach mid-way
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=stop)
    want, _, _ = _run(model, prompts, params)
    got, _, _ = _run(model, prompts, params, speculative_model="ngram", num_speculative_tokens=6)
    assert got == want
    for n in (1, 2, 7):  # max_tokens lands inside a draft: never more tokens than asked
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        got, _, _ = _run(model, prompts, p, speculative_model="ngram", num_speculative_tokens=6)
        assert got == [t[:n] for t in plain]


def test_ngram_proposer():
    prop = NgramProposer(max_n=3, min_n=1)
    assert prop.propose([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]  # the longest suffix match
    assert prop.propose([1, 2, 3, 4], 2) == []  # nothing repeats
    assert prop.propose([4, 1, 4], 5) == [1, 4]  # bounded by what follows
    assert prop.propose([7] * 10, 4) == [7, 7, 7, 7]  # a run: an earlier match with k tokens after it
    assert prop.propose([1, 2, 3, 1, 2, 3, 1, 2], 4) == [3, 1, 2]  # the latest match that has them
    assert NgramProposer(4, 2).propose([1, 9, 2, 9], 2) == []  # a 1-gram match is below min_n


def _chi_square_ok(samples: torch.Tensor, p: torch.Tensor) -> bool:
    """Pearson's chi-square against p, below its 99.9% quantile (Wilson-Hilferty approximation)."""
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * samples.numel()
    keep = expected > 5
    stat = (((counts - expected) ** 2 / expected)[keep]).sum().item()
    df = int(keep.sum()) - 1
    z = 3.09  # the 99.9% point of the standard normal
    return stat < df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize("draft_kind", ["one-hot (prompt lookup)", "a draft distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    g = torch.Generator().manual_seed(0)
    vocab, n = 12, 200_000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    draft = torch.multinomial(q, n, replacement=True, generator=g)
    if draft_kind.startswith("one-hot"):
        draft = torch.full((n,), int(q.argmax()))
        q = torch.nn.functional.one_hot(q.argmax(), vocab).float()
    ok, tokens = rejection_sample(p.expand(n, -1), q.expand(n, -1), draft, generator=g)
    assert _chi_square_ok(tokens, p)
    assert abs(ok.float().mean().item() - torch.minimum(p, q).sum().item()) < 0.01  # acceptance = sum min(p, q)


def test_drafting_pauses_while_it_costs_more_per_token_and_probes_again():
    from types import SimpleNamespace

    from strata.engine.speculative import MIN_SAMPLES, PROBE_EVERY, PROBE_STEPS, Speculator

    spec = Speculator(4, NgramProposer(2, 1))
    seq = SimpleNamespace(grammar=None, request=SimpleNamespace(params=SimpleNamespace(structured=None)),
                          token_ids=[1, 2, 3, 1, 2], seq_id=0)
    for _ in range(MIN_SAMPLES):
        spec.observe_step(True, 0.030, 2)  # 15 ms per token while drafting
        spec.observe_step(False, 0.010, 1)  # 10 ms per token plainly
    assert spec.paused
    drafted = []
    for _ in range(PROBE_EVERY):
        drafted.append(bool(spec.draft(seq, 4)))
        spec.observe_step(False, 0.010, 1)
    assert sum(drafted) == PROBE_STEPS  # only the probe windows draft
    for _ in range(40):  # drafting got cheap: it resumes
        spec.observe_step(True, 0.012, 3)
    assert not spec.paused and spec.draft(seq, 4) == [3, 1, 2]


@pytest.mark.parametrize("draft_family", ["llama", "qwen3"])
def test_a_draft_model_gives_plain_decodings_tokens(tiny_models, draft_family):
    """The target drafting with itself accepts (nearly) everything; another model of the same
    vocabulary accepts less; both give exactly the plain greedy tokens, also under preemption."""
    model = tiny_models["llama"]
    prompts = _prompts(model.vocab_size) * 2
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    small = dict(kv_cache_memory=model.kv_bytes_for(160), max_num_seqs=8)
    plain, _, _ = _run(model, prompts, params, **small)
    spec, stats, preempted = _run(model, prompts, params, speculative_model=str(tiny_models[draft_family].path),
                                  num_speculative_tokens=3, **small)
    assert spec == plain and preempted > 0 and stats.drafted > 0
    if draft_family == "llama":
        assert stats.acceptance_rate > 0.9


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_models, text_model):
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="vocabulary"):
        make_llm(tiny_models["llama"], speculative_model=str(text_model.path))


def test_a_draft_model_with_a_shorter_context_is_refused(tiny_models, tmp_path):
    import json
    import shutil

    from strata.errors import ConfigError

    short = tmp_path / "short"
    shutil.copytree(tiny_models["qwen3"].path, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="fewer than max_model_len"):
        make_llm(tiny_models["llama"], speculative_model=str(short))  # make_llm: max_model_len 96
