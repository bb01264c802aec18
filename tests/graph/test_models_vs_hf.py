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


def test_plain_forward_matches_hf(tiny_model, hf_forward, prompt_of):
    batch = [prompt_of(1, 50), prompt_of(2, 50)]
    got = _strata_logits(tiny_model, batch)
    for b, ids in enumerate(batch):
        ref = hf_forward(tiny_model, ids)
        torch.testing.assert_close(got[b], ref, atol=ATOL, rtol=0)


def test_plain_forward_long_positions(tiny_model, hf_forward, prompt_of):
    """Positions well past original_max_position_embeddings (llama3 scaling), up to 200."""
    ids = prompt_of(3, 200)
    torch.testing.assert_close(_strata_logits(tiny_model, [ids])[0], hf_forward(tiny_model, ids),
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

    def sampler(logits, seqs):
        for row, seq in zip(logits, seqs):
            records.append((seq.request.request_id, seq.index, list(seq.token_ids), row.detach().clone()))
        return original(logits, seqs)

    llm.engine.sampler = sampler
    return records


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_paged_path_matches_hf(tiny_model, backend, llm_factory, hf_forward, prompt_of, engine_clean):
    """Chunked prefill (budget 16 < prompt), block-boundary lengths, mixed prefill/decode steps."""
    llm = llm_factory(tiny_model, max_num_batched_tokens=16, attention_backend=backend)
    records = _capture(llm)
    prompts = [prompt_of(10, 40), prompt_of(11, 16), prompt_of(12, 33), prompt_of(13, 5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    engine_clean(llm)
    by_request = {o.request_id: o for o in outs}
    assert len(records) == sum(len(o.outputs[0].token_ids) for o in outs)
    full_ref = {
        rid: hf_forward(tiny_model, o.prompt_token_ids + o.outputs[0].token_ids)
        for rid, o in by_request.items()
    }
    for rid, _, ids, row in records:
        out = by_request[rid]
        n = len(ids)
        assert ids == (out.prompt_token_ids + out.outputs[0].token_ids)[:n]
        torch.testing.assert_close(row, full_ref[rid][n - 1], atol=ATOL, rtol=0,
                                   msg=lambda m, rid=rid, n=n: f"request {rid} at length {n}: {m}")


def test_paged_single_token_prompt(tiny_model, llm_factory, hf_forward, engine_clean):
    llm = llm_factory(tiny_model)
    records = _capture(llm)
    out = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    full = hf_forward(tiny_model, [7] + out.outputs[0].token_ids)
    assert [len(r[2]) for r in records] == [1, 2, 3]
    for _, _, ids, row in records:
        torch.testing.assert_close(row, full[len(ids) - 1], atol=ATOL, rtol=0)
    engine_clean(llm)


def test_sliding_window_caps_max_model_len(tiny_models, tmp_path, llm_factory, hf_ref, prompt_of):
    """Sliding-window attention is not implemented: max_model_len is capped to the window."""
    dst = tmp_path / "mistral_sw"
    shutil.copytree(tiny_models["mistral"].path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = 32
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = llm_factory(dst, max_model_len=96)
    assert llm.engine.max_model_len == 32
    prompt = prompt_of(20, 20)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.token_ids == hf_ref(tiny_models["mistral"], prompt, 12, stop_at_eos=False)
