"""LoRA inside the fused CPU decode step (platform/cpu_decode_step.py, kernels/cpu_decode_layer.lora_layer,
kernels/cpu_lora.py) against the eager decoder (the model's forward, whose projections add the adapters
through graph/lora.project) in the same `lora_batch`: one step mixing no adapter, adapter A, adapter
B and A again gives the same logprobs and greedy tokens, for fp32, bf16, int8 and int4 bases and the
qkv-bias (Qwen2), q/k-norm (Qwen3) and MoE (attention banks) layers, through both the step's call and
its multi-step `next`. With banks but no adapter active, the step is the one without banks, bit for bit.

The decode step is driven directly here (its own KV caches, prefill by the model's forward), each call
inside lora_batch(LoRABatch.of(slots)), as the engine's runner calls it."""

from __future__ import annotations

import pytest
import torch

from strata.graph.lora import LoRABank, LoRABatch, lora_batch
from strata.graph.lora_adapter import attach_banks
from strata.kernels import cpu_decode_layer
from strata.kernels.attention import AttentionMetadata, PrefillSpan
from strata.memory.kv_cache import allocate_kv_cache
from strata.platform import cpu_layers
from strata.platform.cpu_decode_step import CpuDecodeStep

pytestmark = pytest.mark.skipif(not cpu_decode_layer.available(), reason="numba is not installed")

BLOCK = 16
SLOTS = [-1, 0, 1, 0]  # no adapter, A, B, A again
PROMPT_LENS = [5, 9, 3, 12]
STEPS = 6


def _fill(model, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Banks of 3 slots, rank 8, on every LoRA site; slot 0 (A) a rank-8 adapter on every projection,
    slot 1 (B) a rank-4 one (zero-padded) that leaves v_proj and up_proj out."""
    sites = attach_banks(model, slots=3, rank=8, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    banks = {id(s.module): s.module.lora for s in sites.values()}
    for slot, rank, skip in ((0, 8, ()), (1, 4, ("v_proj", "up_proj"))):
        per: dict[int, dict] = {}
        for hf, site in sites.items():
            if hf.rsplit(".", 1)[-1] in skip:
                continue
            a = torch.randn(rank, site.in_features, generator=g) * 0.15
            b = torch.randn(site.out_features, rank, generator=g) * 0.15
            per.setdefault(id(site.module), {})[site.segment] = (a, b, 2.0 / (1 + slot))
        for key, segs in per.items():
            banks[key].set_slot(slot, segs)
    return sites


class _Decode:
    """Four sequences over their own KV caches: the eager forward prefills them, then decode steps run
    either through a CpuDecodeStep or through the model's forward (a copy of the caches each)."""

    def __init__(self, model, prompts) -> None:
        self.model, self.prompts = model, prompts
        cfg = model.config
        self.per = (max(PROMPT_LENS) + STEPS + 2 + BLOCK - 1) // BLOCK  # blocks per sequence
        self.caches = allocate_kv_cache(cfg, 1 + len(prompts) * self.per, BLOCK, torch.float32, "cpu")
        self.tables = torch.tensor([[1 + r * self.per + b for b in range(self.per)] for r in range(len(prompts))])

    def _slots(self, r: int, pos: torch.Tensor) -> torch.Tensor:
        return self.tables[r][pos // BLOCK] * BLOCK + pos % BLOCK

    def prefill(self, slots) -> list[int]:
        """Each prompt through the eager forward with its row's adapter; the first greedy tokens."""
        first = []
        with torch.inference_mode():
            for r, p in enumerate(self.prompts):
                pos = torch.arange(len(p))
                meta = AttentionMetadata(self._slots(r, pos), [PrefillSpan(0, len(p), 0, self.tables[r], None)],
                                         len(p), None, None, None, "cpu")
                with lora_batch(LoRABatch.of([slots[r]] * len(p))):
                    hidden = self.model(torch.tensor(p), pos, meta, self.caches)
                first.append(int(self.model.compute_logits(hidden[-1:]).argmax()))
        return first

    def meta(self, pos: torch.Tensor) -> AttentionMetadata:
        slots = torch.stack([self._slots(r, pos[r]) for r in range(len(pos))])
        return AttentionMetadata(slots, [], 0, self.tables, None, pos + 1, "cpu")

    def run(self, first: list[int], slots, step: CpuDecodeStep | None, use_next: bool = True,
            adapters: bool = True) -> list[torch.Tensor]:
        """STEPS decode steps from `first`, greedy; the log-softmax of each step's logits [rows, vocab].
        step None: the model's forward (the eager reference); else the fused step, every other step
        through its `next` (use_next). Runs on a copy of the prefilled caches (a step's own, the same
        tensors from one run to the next: the step keeps what it built for them)."""
        model = self.model
        if step is None or step.kv_caches is self.caches:
            caches = [c.clone() for c in self.caches]
            if step is not None:
                step.kv_caches = caches
        else:
            caches = step.kv_caches
            for c, prefilled in zip(caches, self.caches):
                c.copy_(prefilled)
        pos = torch.tensor([len(p) for p in self.prompts])
        tokens, out = first, []
        batch = LoRABatch.of(slots) if adapters else None
        with torch.inference_mode(), lora_batch(batch):
            for t in range(STEPS):
                ids = torch.tensor(tokens)
                if step is None:
                    hidden = model(ids, pos, self.meta(pos), caches)
                    logits = model.compute_logits(hidden)
                else:
                    hidden = step.next(tokens) if use_next and t % 2 else step(ids, pos, self.meta(pos))
                    assert hidden is not None, "the fused step did not run"
                    logits = step.logits_of(hidden)
                    logits = model.compute_logits(hidden) if logits is None else logits
                out.append(torch.log_softmax(logits.float(), -1))
                tokens = logits.argmax(-1).tolist()
                pos = pos + 1
        return out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _assert_close(got, want, tol: float = 1e-5) -> None:
    for g, w in zip(got, want):
        assert torch.equal(g.argmax(-1), w.argmax(-1))  # the same greedy tokens, so the same paths
        assert (g - w).abs().max().item() <= tol


def _runs(step: CpuDecodeStep, rows: int, lora: bool) -> list:
    stack = step._stacks[(rows, lora)]
    return [run for run, _ in stack.entries]


CASES = [("llama", None, 1), ("qwen2", None, 2), ("qwen2", "bf16", 1), ("qwen2", "int8", 2), ("qwen2", "int4", 2),
         ("qwen3", None, 2), ("qwen3moe", None, 1)]


def _fused_equals_eager(llm, vocab: int, moe: bool = False, dtype: torch.dtype = torch.float32) -> None:
    try:
        model = llm.engine.model
        _fill(model, dtype=dtype)
        d = _Decode(model, _prompts(vocab))
        first = d.prefill(SLOTS)
        eager = d.run(first, SLOTS, None)
        step = CpuDecodeStep(model, d.caches, BLOCK)
        fused = d.run(first, SLOTS, step)
        _assert_close(fused, eager)
        lora_run = cpu_layers._moe_lora_run if moe else cpu_decode_layer.lora_layer
        assert all(run is lora_run for run in _runs(step, len(SLOTS), True))  # every layer, adapters inside
        # the adapters matter: without them the adapter rows differ, the no-adapter row does not
        base = d.run(first, SLOTS, None, adapters=False)[0]
        diff = (base - eager[0]).abs().amax(-1)
        assert diff[0] < 1e-5 and (diff[1:] > 1e-2).all()
    finally:
        llm.close()


@pytest.mark.parametrize(("family", "quantization", "threads"), CASES)
def test_fused_lora_decode_equals_the_eager_decoder(family, quantization, threads, tiny_models, llm_factory):
    llm = llm_factory(tiny_models[family], quantization=quantization, num_threads=threads,
                      enable_prefix_caching=False)
    _fused_equals_eager(llm, tiny_models[family].vocab_size, moe=family.endswith("moe"))


@pytest.mark.parametrize(("family", "quantization"), [("llama", None), ("qwen2", "int4"), ("qwen3moe", "int8")])
def test_fused_lora_decode_with_bf16_banks(family, quantization, tiny_models, llm_factory):
    """lora_dtype bfloat16: the banks' bf16 bits widened in the kernel, the same as the eager layer's."""
    llm = llm_factory(tiny_models[family], quantization=quantization, num_threads=2, enable_prefix_caching=False)
    _fused_equals_eager(llm, tiny_models[family].vocab_size, moe=family.endswith("moe"), dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_1", "Q4_1"])  # grouped int8; int8 and int4 with zero points
def test_fused_lora_decode_over_gguf_layouts(kind, tiny_models, llm_factory, tmp_path):
    from gguf import GGMLQuantizationType

    from tests.graph.gguf_writer import write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(tiny_models["llama"].hf, path, GGMLQuantizationType[kind], embed_type=GGMLQuantizationType.Q8_0)
    llm = llm_factory(path, num_threads=2, enable_prefix_caching=False)
    qkv = llm.engine.model.layers[0].self_attn.qkv_proj
    assert qkv.method == ("int4" if kind == "Q4_1" else "int8") and qkv.scale.dim() == (2 if kind == "Q8_0" else 3)
    _fused_equals_eager(llm, tiny_models["llama"].vocab_size)


def test_no_adapter_active_is_the_step_without_banks(tiny_models, llm_factory):
    """Bit for bit: banks attached (and filled) but no batch, or a batch of no adapter. Banks attached
    after the step built its stacks are noticed at its next re-check (weights_may_have_changed)."""
    llm = llm_factory(tiny_models["qwen2"], num_threads=2, enable_prefix_caching=False)
    try:
        model = llm.engine.model
        d = _Decode(model, _prompts(tiny_models["qwen2"].vocab_size))
        first = d.prefill([-1] * 4)
        step = CpuDecodeStep(model, d.caches, BLOCK)
        plain = d.run(first, SLOTS, step, adapters=False)
        same = d.run(first, SLOTS, step)  # a batch, but no banks yet: the plain layers
        assert all(run is cpu_decode_layer.llama_layer for run in _runs(step, 4, True))
        assert all(torch.equal(a, b) for a, b in zip(same, plain))
        _fill(model)
        step.weights_may_have_changed()
        assert all(torch.equal(a, b) for a, b in zip(d.run(first, SLOTS, step, adapters=False), plain))
        assert all(torch.equal(a, b) for a, b in zip(d.run(first, [-1] * 4, step), plain))  # LoRABatch.of: None
        assert (4, True) not in step._stacks  # rebuilt: the banks were noticed
        got = d.run(first, SLOTS, step)
        assert all(run is cpu_decode_layer.lora_layer for run in _runs(step, 4, True))
        _assert_close(got, d.run(first, SLOTS, None))
    finally:
        llm.close()


def test_a_bank_the_kernels_cannot_read_runs_its_layer_eagerly(tiny_models, llm_factory):
    llm = llm_factory(tiny_models["llama"], enable_prefix_caching=False)
    try:
        model = llm.engine.model
        _fill(model)
        model.layers[1].self_attn.o_proj.lora.double()  # fp64: no kernel here
        d = _Decode(model, _prompts(tiny_models["llama"].vocab_size))
        first = d.prefill(SLOTS)
        step = CpuDecodeStep(model, d.caches, BLOCK)
        fused = d.run(first, SLOTS, step, use_next=False)  # (next: only after an all-fused step)
        stack = step._stacks[(4, True)]
        assert stack.eager == {1: "a LoRA bank not plain fp32 or bf16 on CPU"}
        assert all(run is cpu_decode_layer.lora_layer for i, (run, _) in enumerate(stack.entries) if i != 1)
        _assert_close(fused, d.run(first, SLOTS, None))
    finally:
        llm.close()


def test_bad_token_slots_are_refused(tiny_models, llm_factory):
    llm = llm_factory(tiny_models["llama"], enable_prefix_caching=False)
    try:
        model = llm.engine.model
        _fill(model)
        d = _Decode(model, _prompts(tiny_models["llama"].vocab_size))
        first = d.prefill(SLOTS)
        step = CpuDecodeStep(model, d.caches, BLOCK)
        pos = torch.tensor(PROMPT_LENS)
        with torch.inference_mode():
            with lora_batch(LoRABatch.of([0, 1, 0])), pytest.raises(ValueError, match="3 token slots for a decode step of 4 rows"):
                step(torch.tensor(first), pos, d.meta(pos))
            with lora_batch(LoRABatch.of([0, 3, 0, -1])), pytest.raises(ValueError, match="the banks hold 3 adapters"):
                step(torch.tensor(first), pos, d.meta(pos))
            with lora_batch(LoRABatch.every_row(1)):  # groups only, no token slots: every row slot 1
                hidden = step(torch.tensor(first), pos, d.meta(pos))
        assert hidden is not None
        assert step._stacks[(4, True)].lora.token_slots.tolist() == [1, 1, 1, 1]
    finally:
        llm.close()


def test_lora_on_moe_experts_runs_the_layer_eagerly(tiny_models, llm_factory):
    llm = llm_factory(tiny_models["qwen3moe"], enable_prefix_caching=False)
    try:
        layer = llm.engine.model.layers[0]
        expert = layer.mlp.experts[0].down_proj
        expert.lora = LoRABank(expert.in_features, [(0, expert.out_features)], 2, 4)
        kv = allocate_kv_cache(llm.engine.model.config, 2, BLOCK, torch.float32, "cpu")[0]
        rows = cpu_layers.LoRARows(2)
        with torch.inference_mode():
            assert cpu_layers.build(layer, kv, 2, rows) == "LoRA banks on MoE experts"
            assert cpu_layers.build(layer, kv, 2)[0] is cpu_layers._moe_run  # no adapters this step: as ever
    finally:
        llm.close()
