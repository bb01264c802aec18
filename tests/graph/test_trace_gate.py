"""Tracing next to running forwards (graph/trace_gate.py): torch.fx patches torch.nn.Module.__call__
process-wide while it traces, so fusing one model while another thread runs eager forwards of
another must leave those forwards' outputs and the fusion counts exactly as when each runs alone.
The kernel mode the tracer sets (reference kernels) is its own thread's: the other thread keeps
its numba fast paths."""

from __future__ import annotations

import threading

import pytest
import torch

from strata.graph import fusion
from strata.graph.models.llama import CausalLM
from strata.graph.trace_gate import TraceGate
from strata.kernels import dispatch
from strata.kernels.attention import AttentionMetadata, PrefillSpan
from strata.model_config import ModelConfig

TOKENS, BLOCK = 12, 16  # few rows: the eager step takes the numba kernels (fp32, CPU)


def _model(cfg: ModelConfig, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _step_inputs(cfg: ModelConfig):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (TOKENS,), generator=g)
    positions = torch.arange(TOKENS)
    blocks = -(-TOKENS // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(TOKENS), prefills=[PrefillSpan(0, TOKENS, 0, torch.arange(blocks), None)],
        num_prefill_tokens=TOKENS, decode_block_tables=None, decode_mask=None, backend="cpu",
    )
    caches = [torch.zeros(2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    return ids, positions, meta, caches


def test_fuse_while_another_thread_runs_forwards(tiny_models):
    cfg = ModelConfig.from_file(tiny_models["llama"].path / "config.json")
    traced, running = _model(cfg, 1), _model(cfg, 2)
    ids, positions, meta, caches = _step_inputs(cfg)
    with torch.inference_mode():
        want = running(ids, positions, meta, caches)

    outputs, modes, errors = [], [], []
    started, stop = threading.Event(), threading.Event()

    def forwards():
        try:
            with torch.inference_mode():
                while not stop.is_set():
                    modes.append(dispatch.current())
                    outputs.append(running(ids, positions, meta, caches))
                    started.set()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            started.set()

    worker = threading.Thread(target=forwards, daemon=True)
    worker.start()
    try:
        assert started.wait(60)
        counts = [fusion.fuse_model(traced).counts for _ in range(3)]
        before = len(outputs)
        while len(outputs) < before + 2 and not errors:  # forwards go on after the traces
            threading.Event().wait(0.01)
    finally:
        stop.set()
        worker.join(60)
    assert not errors, errors[0]
    assert len(outputs) >= 3
    assert all(torch.equal(out, want) for out in outputs)
    assert set(modes) == {dispatch.DEFAULT}  # the tracer's reference mode never reached this thread
    assert counts == [fusion.expected_counts(cfg.num_layers)] * 3
    # and the fused step of the traced model still computes what its eager step computes
    with torch.inference_mode():
        fused_ids, fused_pos, fused_meta, fused_caches = _step_inputs(cfg)
        eager = traced(*_step_inputs(cfg))
        torch.testing.assert_close(fusion.fuse_model(traced)(fused_ids, fused_pos, fused_meta, fused_caches),
                                   eager, rtol=1e-5, atol=1e-5)


def test_gate_is_reentrant_and_refuses_tracing_inside_a_forward():
    gate = TraceGate()
    with gate.exclusive():
        with gate.exclusive(), gate.shared(), gate.shared():  # the tracer's own forward calls
            pass
    with gate.shared(), gate.shared():
        with pytest.raises(RuntimeError, match="inside a model forward"):
            gate.acquire_exclusive()
    order: list[str] = []
    entered = threading.Event()

    def trace():
        entered.set()
        with gate.exclusive():
            order.append("trace")

    with gate.shared():
        t = threading.Thread(target=trace)
        t.start()
        entered.wait(10)
        t.join(0.2)
        assert t.is_alive()  # the trace waits for the running forward
        order.append("forward")
    t.join(10)
    assert order == ["forward", "trace"]
    with gate.exclusive():  # and the gate is free again
        pass
