"""The engine end to end against a plain greedy loop over transformers' forward.

Greedy tokens must match token for token: one request alone, a mixed batch under a tiny token
budget and a KV cache so small that preemption (recompute) must happen, n > 1 (forks), aborts,
and stop strings on a checkpoint with a real tokenizer.
"""

from __future__ import annotations

import pytest

from strata import SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
MIXED_LENGTHS = (3, 60, 17, 33, 8)


def test_single_request_greedy(family_model, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(family_model)
    prompt = prompt_of(100, 21)
    out = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(out) == 1
    comp = out[0].outputs[0]
    ref = hf_ref(family_model, prompt, MAX_NEW)
    assert comp.token_ids == ref
    assert comp.finish_reason == ("stop" if ref[-1] in family_model.eos_ids else "length")
    assert out[0].finished and out[0].num_preemptions == 0
    engine_clean(llm)


def test_batch_with_chunking_and_preemption(family_model, llm_factory, hf_ref, prompt_of, engine_clean):
    """5 mixed-length prompts, budget 16 tokens/step, KV cache = one max_model_len sequence."""
    llm = llm_factory(
        family_model, max_num_batched_tokens=16, kv_cache_memory=family_model.kv_bytes_for(96)
    )
    assert llm.engine.block_manager.num_blocks == 6
    prompts = [prompt_of(200 + i, n) for i, n in enumerate(MIXED_LENGTHS)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts  # input order
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.outputs[0].token_ids == hf_ref(family_model, p, MAX_NEW), f"prompt {i} (len {len(p)})"
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    engine_clean(llm)


def test_one_token_prefill_chunk(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    """Budget 16, prompts 31 and 10: step 2 has 1 token of budget left for the second prompt.

    That 1-token chunk is part of a prefill, not a decode: nothing may be sampled from it.
    """
    llm = llm_factory(llama, max_num_batched_tokens=16)
    prompts = [prompt_of(300, 31), prompt_of(301, 10)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(llama, p, 8)
    engine_clean(llm)


def test_runner_samples_exactly_the_completed_sequences(llama, llm_factory, prompt_of):
    """The runner returns logits for a sequence iff its step computes its last known token."""
    llm = llm_factory(llama, max_num_batched_tokens=16)
    runner = llm.engine.runner
    execute = runner.execute
    wrong = []

    def checked(out):
        should = sorted(s.seq.seq_id for s in out.scheduled if s.samples)
        chunks = [(s.seq.seq_id, s.seq.num_computed_tokens, s.num_tokens, s.seq.num_tokens)
                  for s in out.scheduled]
        logits, order = execute(out)
        if sorted(s.seq_id for s in order) != should:
            wrong.append((chunks, [s.seq_id for s in order]))
        return logits, order

    runner.execute = checked
    llm.generate([prompt_of(300, 31), prompt_of(301, 10)], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    assert not wrong, f"(seq, computed, chunk, total) scheduled -> sampled seqs: {wrong}"


def test_budget_leftovers_sweep(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    """Many prompt lengths with a 7-token budget: chunks of every size, including 1."""
    llm = llm_factory(llama, max_num_batched_tokens=7, kv_cache_memory=llama.kv_bytes_for(2 * 96))
    prompts = [prompt_of(400 + n, n) for n in (1, 2, 6, 7, 8, 13, 15, 16, 17, 29)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(llama, p, 5), f"prompt of {len(p)}"
    engine_clean(llm)


def test_max_num_seqs_one(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(llama, max_num_seqs=1)
    prompts = [prompt_of(500 + i, 5 + i) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(llama, p, 4)
    engine_clean(llm)


def test_max_model_len_caps_output(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    llm = llm_factory(llama, max_model_len=32)
    prompt = prompt_of(600, 28)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(prompt) + len(comp.token_ids) == 32
    assert comp.finish_reason == "length"
    assert comp.token_ids == hf_ref(llama, prompt, 4, stop_at_eos=False)
    engine_clean(llm)


# --- n > 1 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [16, 21])  # full last block (shared) / partial (copied)
def test_n3_greedy_identical(llama, llm_factory, hf_ref, prompt_of, engine_clean, prompt_len):
    llm = llm_factory(llama)
    prompt = prompt_of(700, prompt_len)
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW),
                       use_tqdm=False)[0]
    ref = hf_ref(llama, prompt, MAX_NEW)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    engine_clean(llm)


def test_n3_single_token(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    """Fork and finish in the same step."""
    llm = llm_factory(llama)
    prompt = prompt_of(750, 20)
    out = llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_ref(llama, prompt, 1)] * 3
    assert out.finished
    engine_clean(llm)


def test_n3_greedy_under_preemption(llama, llm_factory, hf_ref, prompt_of, engine_clean):
    """Forks sharing blocks, partial-block copies and recompute preemption all at once."""
    llm = llm_factory(llama, max_num_batched_tokens=16, kv_cache_memory=llama.kv_bytes_for(96))
    prompts = [prompt_of(800, 21), prompt_of(801, 9), prompt_of(802, 40)]
    params = [SamplingParams(n=3, temperature=0, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24),
              SamplingParams(n=2, temperature=0, max_tokens=24)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, sp, o in zip(prompts, params, outs):
        ref = hf_ref(llama, p, 24)
        assert [c.token_ids for c in o.outputs] == [ref] * sp.n
    assert llm.engine.scheduler.num_preemptions > 0
    engine_clean(llm)


def test_n3_seeded_sampling_reproducible(llama, llm_factory, prompt_of, engine_clean):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    prompt = prompt_of(900, 12)
    llm = llm_factory(llama)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    other_engine = llm_factory(llama, seed=123).generate(prompt, params, use_tqdm=False)[0]
    a = [c.token_ids for c in first.outputs]
    assert a == [c.token_ids for c in second.outputs]
    assert a == [c.token_ids for c in other_engine.outputs]
    assert len({tuple(t) for t in a}) > 1, "the three samples should differ from each other"
    engine_clean(llm)


# --- abort -----------------------------------------------------------------------------------


def test_abort_mid_generation_frees_blocks(llama, llm_factory, prompt_of, engine_clean):
    llm = llm_factory(llama, max_num_batched_tokens=16)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("a", None, prompt_of(1000, 30), params)
    eng.add_request("b", None, prompt_of(1001, 12), SamplingParams(n=3, temperature=0, max_tokens=40))
    eng.add_request("c", None, prompt_of(1002, 50), params)
    for _ in range(6):
        eng.step()
        eng.check_blocks()
    assert eng.block_manager.num_free < eng.block_manager.num_blocks
    req_b = eng.requests["b"]
    assert len(req_b.seqs) == 3  # forked
    out = eng.abort("b")
    assert out is not None and out.finished
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert all(not s.block_table for s in req_b.seqs)
    eng.check_blocks()
    assert eng.abort("b") is None and eng.abort("nope") is None
    eng.step()
    eng.check_blocks()
    eng.abort("a")
    eng.abort("c")
    engine_clean(llm)


def test_abort_waiting_request(llama, llm_factory, prompt_of, engine_clean):
    llm = llm_factory(llama, max_num_seqs=1)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=8)
    eng.add_request("a", None, prompt_of(1100, 10), params)
    eng.add_request("b", None, prompt_of(1101, 10), params)
    eng.step()
    assert [s.request.request_id for s in eng.scheduler.waiting] == ["b"]
    out = eng.abort("b")
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    while eng.has_unfinished():
        eng.step()
    engine_clean(llm)


# --- stop strings (needs a tokenizer) --------------------------------------------------------


def _greedy_text(llm, prompt: str, n: int):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0]
    return out.outputs[0]


def _spanning_stop(tok, token_ids: list[int]) -> tuple[str, int, int]:
    """A stop string made of the end of token j and the start of token j+1, first seen there.

    Returns (stop, char index of its first occurrence, index of the token that completes it).
    """
    pieces = [tok.decode([t]) for t in token_ids]
    text = "".join(pieces)
    pos = 0
    for j in range(len(pieces) - 1):
        pos += len(pieces[j])
        a, b = pieces[j], pieces[j + 1]
        for left, right in ((1, 1), (2, 1), (1, 2)):
            if len(a) < left or len(b) < right:
                continue
            stop = a[-left:] + b[:right]
            if stop.strip() and text.find(stop) == pos - left:
                return stop, pos - left, j + 1
    raise AssertionError(f"no token-spanning stop string in {pieces!r}")


def test_stop_string_spanning_tokens(text_model, llm_factory, engine_clean):
    llm = llm_factory(text_model)
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    full = _greedy_text(llm, prompt, 40)
    assert full.text == tok.decode(full.token_ids)
    stop, idx, last_tok = _spanning_stop(tok, full.token_ids)

    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:idx]
    assert stop not in cut.text
    assert cut.token_ids == full.token_ids[: last_tok + 1]

    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                               stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: idx + len(stop)]
    assert kept.text.endswith(stop)
    engine_clean(llm)


def test_stop_strings_earliest_wins_and_absent(text_model, llm_factory, engine_clean):
    llm = llm_factory(text_model)
    prompt = "Every block is"
    full = _greedy_text(llm, prompt, 30)
    text = full.text
    assert len(text) >= 6
    late, early = text[-3:], text[2:4]
    first = min(text.find(late), text.find(early))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop=[late, early]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    never = "\x00never\x00"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                              stop=[never]), use_tqdm=False)[0].outputs[0]
    assert out.text == text and out.finish_reason == "length"
    engine_clean(llm)


def test_streamed_text_is_never_retracted(text_model, llm_factory, engine_clean):
    """Each step's text extends the previous one; a partial stop string is held back, not shown."""
    llm = llm_factory(text_model)
    eng = llm.engine
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    full = _greedy_text(llm, prompt, 40)
    stop, idx, _ = _spanning_stop(tok, full.token_ids)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    eng.add_request("s", prompt, tok.encode(prompt), params)
    texts = []
    while eng.has_unfinished():
        for out in eng.step():
            texts.append(out.outputs[0].text)
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)
    assert texts[-1] == full.text[:idx]
    assert all(stop not in t for t in texts)
    engine_clean(llm)


def _run_engine(eng, tok, prompt: str, params: SamplingParams, rid: str, abort_after: int | None = None):
    """Every output engine.step() returns for one request (or abort()'s, after `abort_after` steps)."""
    eng.add_request(rid, prompt, tok.encode(prompt), params)
    outs, steps = [], 0
    while eng.has_unfinished():
        if abort_after is not None and steps == abort_after:
            return outs + [eng.abort(rid)]
        outs += [o for o in eng.step() if o.request_id == rid]
        steps += 1
    return outs


@pytest.mark.parametrize("model_name", ["text_model", "byte_fallback_model"])
def test_final_only_returns_one_output_with_the_cumulative_text(model_name, request, llm_factory, engine_clean):
    """output_kind FINAL_ONLY (what LLM.generate asks for): engine.step() returns nothing for the
    request until it finishes, then the text, tokens and finish reason a CUMULATIVE run ends with,
    n=2 and stop strings included; an abort returns the text so far, as a CUMULATIVE step's."""
    from strata.protocol.sampling_params import RequestOutputKind

    llm = llm_factory(request.getfixturevalue(model_name))
    eng, tok = llm.engine, llm.get_tokenizer()
    prompt = "The quick brown fox"
    full = _greedy_text(llm, prompt, 40)
    stop = _spanning_stop(tok, full.token_ids)[0] if model_name == "text_model" else None
    for i, kw in enumerate([dict(temperature=0), dict(temperature=0, stop=[stop] if stop else ["zz"]),
                            dict(temperature=0.8, seed=3, n=2), dict(temperature=0, skip_special_tokens=False)]):
        cumulative = SamplingParams(max_tokens=40, ignore_eos=True, **kw)
        final = SamplingParams(max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY, **kw)
        a = _run_engine(eng, tok, prompt, cumulative, f"c{i}")
        b = _run_engine(eng, tok, prompt, final, f"f{i}")
        assert len(a) > 1 and len(b) == 1 and b[0].finished
        for x, y in zip(a[-1].outputs, b[0].outputs, strict=True):
            assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == \
                (x.text, x.token_ids, x.finish_reason, x.stop_reason)
        if "seed" not in kw:
            a = _run_engine(eng, tok, prompt, cumulative, f"ca{i}", abort_after=6)
            b = _run_engine(eng, tok, prompt, final, f"fa{i}", abort_after=6)
            assert len(b) == 1 and b[0].outputs[0].text == a[-1].outputs[0].text
            assert b[0].outputs[0].token_ids == a[-1].outputs[0].token_ids
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine_run = _run_engine(eng, tok, prompt, greedy, "greedy")[-1].outputs[0]
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text == engine_run.text == full.text
    assert greedy.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as given
    engine_clean(llm)


def test_output_kind_delta_is_refused_and_ints_are_taken():
    from strata.errors import RequestError
    from strata.protocol.sampling_params import RequestOutputKind

    with pytest.raises(RequestError, match="output_kind DELTA is not implemented; use CUMULATIVE"):
        SamplingParams(output_kind=RequestOutputKind.DELTA).validate()
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY  # from a msgpack message
    with pytest.raises(RequestError, match="output_kind must be RequestOutputKind"):
        SamplingParams(output_kind="final").validate()


def _is_ascii_byte_token(tok_id: int) -> bool:
    return 3 <= tok_id < 3 + 0x80  # <0x00>..<0x7F> in the byte-fallback fixture


def test_final_text_includes_held_back_bytes(byte_fallback_model, llm_factory, engine_clean):
    """Byte-fallback tokens are held back while streaming; the finished text must release them."""
    llm = llm_factory(byte_fallback_model)
    tok = llm.get_tokenizer()
    prompt = "hello world"
    full = _greedy_text(llm, prompt, 40)
    assert full.text == tok.decode(full.token_ids)
    ends = [i for i, t in enumerate(full.token_ids) if _is_ascii_byte_token(t)]
    assert ends, f"no ASCII byte token in {full.token_ids}"
    for end in ends[:3]:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=end + 1, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[: end + 1]
        assert out.text == tok.decode(out.token_ids), f"text cut after a byte token at {end}"
    engine_clean(llm)


def test_text_prompt_greedy_matches_hf(text_model, llm_factory, hf_ref):
    llm = llm_factory(text_model)
    prompt = "Small models make"
    ids = llm.get_tokenizer().encode(prompt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.prompt == prompt
    assert out.outputs[0].token_ids == hf_ref(text_model, ids, 16)
