"""Every model family against transformers on the same weights (fp32, 1e-4).

Two paths: the plain causal forward ([B, L], no cache) and the engine's paged path (chunked
prefill + decode over the paged KV cache), where the logits the sampler receives are captured.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from strata import SamplingParams
from strata.graph.loader import load_model

ATOL = 1e-4


def _strata_logits(model, batch: list[list[int]]) -> torch.Tensor:
    m = load_model(model.path, torch.float32, "cpu", 256)
    ids = torch.tensor(batch)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return m.compute_logits(m(ids, pos)).float()


def test_plain_forward_matches_hf(family_model, hf_forward, prompt_of):
    batch = [prompt_of(1, 50), prompt_of(2, 50)]
    got = _strata_logits(family_model, batch)
    for b, ids in enumerate(batch):
        ref = hf_forward(family_model, ids)
        torch.testing.assert_close(got[b], ref, atol=ATOL, rtol=0)


def test_plain_forward_long_positions(family_model, hf_forward, prompt_of):
    """Positions well past original_max_position_embeddings (llama3 scaling), up to 200."""
    ids = prompt_of(3, 200)
    torch.testing.assert_close(_strata_logits(family_model, [ids])[0], hf_forward(family_model, ids),
                               atol=ATOL, rtol=0)


def test_llama3_rope_scaling_is_exercised(tiny_models, prompt_of, tmp_path):
    """Guard the fixture: dropping the llama3 scaling must change the logits visibly."""
    src = tiny_models["llama3"].path
    dst = tmp_path / "noscale"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    ids = [prompt_of(4, 120)]
    a = _strata_logits(tiny_models["llama3"], ids)

    class _M:
        path = dst

    b = _strata_logits(_M, ids)
    assert (a - b).abs().max() > 1e-2


def _capture(llm) -> list[tuple[str, int, list[int], torch.Tensor]]:
    """Record (request id, completion index, token ids, logits row) for every sampler call."""
    records = []
    original = llm.engine.sampler

    def sampler(logits, seqs, *rest):
        for row, seq in zip(logits, seqs):
            records.append((seq.request.request_id, seq.index, list(seq.token_ids), row.detach().clone()))
        return original(logits, seqs, *rest)

    llm.engine.sampler = sampler
    return records


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
def test_paged_path_matches_hf(family_model, backend, llm_factory, hf_forward, prompt_of, engine_clean):
    """Chunked prefill (budget 16 < prompt), block-boundary lengths, mixed prefill/decode steps."""
    llm = llm_factory(family_model, max_num_batched_tokens=16, attention_backend=backend)
    records = _capture(llm)
    prompts = [prompt_of(10, 40), prompt_of(11, 16), prompt_of(12, 33), prompt_of(13, 5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    engine_clean(llm)
    by_request = {o.request_id: o for o in outs}
    assert len(records) == sum(len(o.outputs[0].token_ids) for o in outs)
    full_ref = {
        rid: hf_forward(family_model, o.prompt_token_ids + o.outputs[0].token_ids)
        for rid, o in by_request.items()
    }
    for rid, _, ids, row in records:
        out = by_request[rid]
        n = len(ids)
        assert ids == (out.prompt_token_ids + out.outputs[0].token_ids)[:n]
        torch.testing.assert_close(row, full_ref[rid][n - 1], atol=ATOL, rtol=0,
                                   msg=lambda m, rid=rid, n=n: f"request {rid} at length {n}: {m}")


def test_paged_single_token_prompt(family_model, llm_factory, hf_forward, engine_clean):
    llm = llm_factory(family_model)
    records = _capture(llm)
    out = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    full = hf_forward(family_model, [7] + out.outputs[0].token_ids)
    assert [len(r[2]) for r in records] == [1, 2, 3]
    for _, _, ids, row in records:
        torch.testing.assert_close(row, full[len(ids) - 1], atol=ATOL, rtol=0)
    engine_clean(llm)


def test_sliding_window_attends_within_the_window(tiny_models, tmp_path, llm_factory, prompt_of, engine_clean):
    """Mistral with a 32-token window: the context is not capped, and greedy tokens past the window
    match transformers' sliding-window model token for token (cpu backend: the numba kernel)."""
    import transformers as tf

    dst = tmp_path / "mistral_sw"
    shutil.copytree(tiny_models["mistral"].path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = 32
    (dst / "config.json").write_text(json.dumps(cfg))
    hf = tf.MistralForCausalLM.from_pretrained(dst, attn_implementation="eager").float().eval()
    llm = llm_factory(dst, max_model_len=96)
    assert llm.engine.max_model_len == 96
    prompt = prompt_of(20, 20)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(50):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[len(prompt):]
    engine_clean(llm)


def test_window_is_exercised(tiny_models, prompt_of, tmp_path):
    """Guard the Gemma 3 / Phi-3 fixtures: their windows (8, 20) must change 60-token logits."""
    for family in ("gemma3", "phi3"):
        dst = tmp_path / family
        shutil.copytree(tiny_models[family].path, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg["sliding_window"] = None
        (dst / "config.json").write_text(json.dumps(cfg))
        ids = [prompt_of(5, 60)]

        class _M:
            path = dst

        assert (_strata_logits(tiny_models[family], ids) - _strata_logits(_M, ids)).abs().max() > 1e-2, family


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
def test_longrope_long_factors_match_hf(backend, tmp_path, llm_factory, prompt_of, engine_clean):
    """Phi-4-mini shape pre-trained on 32 positions, max_model_len 96: the long factors (and the
    attention factor) apply, and transformers uses them too once a sequence passes 32 tokens."""
    from conftest import make_tiny_model

    model = make_tiny_model("phi4mini-long", tmp_path / "phi4mini-long", seed=7)
    prompt = prompt_of(21, 40)
    ids = list(prompt)
    with torch.no_grad():
        torch.testing.assert_close(_strata_logits(model, [ids])[0], model.hf(torch.tensor([ids])).logits[0],
                                   atol=ATOL, rtol=0)
        for _ in range(32):
            ids.append(int(model.hf(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = llm_factory(model, attention_backend=backend)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ids[len(prompt):]
    engine_clean(llm)
