"""Measured decode-step kernels of a model at its own shapes, in its own weight format (`this` device).

The rate model prices a decode step as weight bytes at one GEMV rate plus FLOPs at one matmul
rate, both probed on one large matrix. Across CPUs that misses by 15-65%: the model's matrices
are small (576..1536 wide), so thread hand-offs and per-layer calls weigh more than on the probe's
16384 x 4096 matrix; the quantised probe matrix (64 MiB) sits in a large L3 on some machines and
not others; and the engine runs each decoder layer as one fused call (platform/cpu_decode_step.py) whose
cost no rate describes. So for `this` device the planner builds the model itself with random
weights, with as many layers as span SPAN_BYTES of weights (all of them when the model is
smaller: then the cache holds in the probe what it holds in the run), stored the way the engine
stores them (bf16 narrowing, int8/int4 quantisation, the prefill GEMM marks), and times the
engine's forward pass for decode steps of PROBE_BATCHES sequences at PROBE_CONTEXT tokens each,
then the LM head on the step's rows. The decode price composes these: layers x the per-layer time
(interpolated in batch, extended past the last probed batch along its last segment) + the head
time + the KV bytes of the real context beyond PROBE_CONTEXT at the measured memory bandwidth.

A probe keeps its model so `retime` can measure again (plan-accuracy re-times just before and
after each measured run: the memory bandwidth of a shared VM moves within minutes).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass

import torch

from strata.graph.models.llama import CausalLM
from strata.graph.moe import Router
from strata.hardware import probe as hw_probe
from strata.kernels.attention import AttentionMetadata, PrefillSpan, select_backend
from strata.memory.arena import rehome_in_arena
from strata.memory.bf16_weights import narrow_model
from strata.memory.kv_cache import allocate_kv_cache
from strata.memory.planner import weight_bytes
from strata.memory.quant import quantize_model
from strata.model_config import ModelConfig
from strata.planner.cost_model import Device, ModelShape, decode_step
from strata.platform.cpu_decode_step import CpuDecodeStep
from strata.platform.cpu_policy import mark_prefill_gemms

logger = logging.getLogger(__name__)

PROBE_BATCHES = (1, 4, 16, 64)
PROBE_CONTEXT = 128
BLOCK = 16
# weight bytes the probe's layers span: past the last-level cache of the CPUs measured so far
# (a Zen 4 CCD holds 32 MiB, the Xeon VM reports 480 MiB over its sockets but holds ~105 MiB)
SPAN_BYTES = 256 * 2**20
WARMUP, REPEATS = 2, 7
# the plan times the model's layers within these, else prices decode from the rates
DECODE_PROBE_BUDGET_S = 20.0
DECODE_PROBE_MEMORY_SHARE = 0.4
# prompts the probe's model also times whole (plan.py scales the prefill layer probe to it)
PREFILL_MAX_TOKENS = 512
PREFILL_WARMUP, PREFILL_REPEATS = 1, 3


@dataclass(frozen=True)
class DecodeTimes:
    """Seconds of one decode step's kernels per probed batch: per decoder layer (the forward pass
    over the probe's layers, divided by their count) and the LM head over the step's rows."""

    batches: tuple[int, ...]
    layer_s: tuple[float, ...]
    head_s: tuple[float, ...]
    context: int
    layers: int  # decoder layers the probe built

    def at(self, batch: int) -> tuple[float, float]:
        """(per-layer, head) seconds at `batch`, piecewise-linear in batch."""
        return _interp(self.batches, self.layer_s, batch), _interp(self.batches, self.head_s, batch)


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = next((i for i in range(len(xs) - 1) if x <= xs[i + 1]), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def store_like_engine(model, quantization: str | None, group: int, device: str) -> None:
    """The engine's weight formats and placement (engine/build.py: load into a weight arena,
    quantize, then mark_gemms): the arena's transparent huge pages make the GEMVs ~14% faster."""
    if quantization is None and device == "cpu":
        rehome_in_arena(model)  # the loader's arena (quantisation re-homes in its own)
    elif quantization == "bf16":
        narrow_model(model)
    elif quantization is not None:
        quantize_model(model, quantization, group)
    if device == "cpu":
        mark_prefill_gemms(model, hw_probe.probe("cpu"))


@torch.no_grad()
def init_routers(model: torch.nn.Module) -> None:
    """N(0, 0.02) router weights (an MoE layer's Router is built uninitialised, for the loader):
    unit-scale hidden rows then pick varied experts, as trained routers do, and a step of b rows
    reads about expected_experts(E, k, b) of them, not the same few (all-zero scores tie)."""
    for module in model.modules():
        if isinstance(module, Router):
            module.weight.normal_(0.0, 0.02)


def layers_to_build(cfg: ModelConfig, layer_bytes: int) -> int:
    return max(1, min(cfg.num_layers, math.ceil(SPAN_BYTES / max(layer_bytes, 1))))


class DecodeProbe:
    """The model at `cfg`'s shapes with `layers_to_build` layers, its KV caches and step inputs."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int,
                 device: str = "cpu", layer_bytes: int | None = None) -> None:
        if layer_bytes is None:
            layer_bytes = estimate_layer_bytes(cfg, dtype, quantization, group)
        self.cfg, self.device = cfg, torch.device(device)
        built = dataclasses.replace(cfg, num_layers=layers_to_build(cfg, layer_bytes))
        torch.manual_seed(0)
        with torch.device(self.device):
            self.model = CausalLM(built, max_positions=max(PROBE_CONTEXT, PREFILL_MAX_TOKENS) + 1).to(dtype).eval()
        self.model.requires_grad_(False)
        init_routers(self.model)
        store_like_engine(self.model, quantization, group, device)
        self.layers = built.num_layers
        self.backend = select_backend("auto", device, dtype)
        blocks_per_seq = -(-(PROBE_CONTEXT + 1) // BLOCK)
        blocks = max(max(PROBE_BATCHES) * blocks_per_seq, -(-PREFILL_MAX_TOKENS // BLOCK))
        self.kv_caches = allocate_kv_cache(built, blocks, BLOCK, dtype, device)  # the engine's allocation
        # Written, as the engine's prefill writes the context it attends over: untouched, the
        # cache's pages all map the kernel's one zero page, which stays in L1, and attention over
        # them ran ~20% of a layer faster than over real keys (smol-135m int8 at batch 16, Zen 5:
        # batch-16 decode predicted 15-25% too fast in every format).
        gen = torch.Generator(device=self.device).manual_seed(0)
        for cache in self.kv_caches:
            cache.normal_(generator=gen)
        self.blocks_per_seq = blocks_per_seq
        # the engine's decode step on CPU (the fused layer loop), its head left out: timed apart
        self.step = CpuDecodeStep(self.model, self.kv_caches, BLOCK, fused_head=False) if device == "cpu" else None

    def _decode(self, ids, positions, meta, kv_caches) -> torch.Tensor:
        """The layers and final norm of a decode step, as the engine runs them."""
        hidden = None if self.step is None else self.step(ids, positions, meta)
        return self.model(ids, positions, meta, kv_caches) if hidden is None else hidden

    def _step_inputs(self, batch: int):
        dev, n, pos = self.device, self.blocks_per_seq, PROBE_CONTEXT
        tables = torch.arange(batch * n, device=dev).view(batch, n)
        positions = torch.full((batch,), pos, dtype=torch.long, device=dev)
        slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK
        mask = None
        if self.backend.uses_decode_mask:
            keys = torch.arange(n * BLOCK, device=dev)
            mask = (keys[None, :] <= positions[:, None]).view(batch, 1, 1, -1)
        meta = AttentionMetadata(slot_mapping=slots, prefills=[], num_prefill_tokens=0,
                                 decode_block_tables=tables, decode_mask=mask, decode_context_lens=positions + 1,
                                 backend=self.backend)
        ids = torch.randint(3, self.cfg.vocab_size, (batch,), device=dev)
        return ids, positions, meta

    def _seconds(self, *fns, warmup: int = WARMUP, repeats: int = REPEATS, min_seconds: float = 0.0) -> list[float]:
        """Mean seconds of each of `fns`, called in turn as one step, after `warmup` steps: at least
        `repeats` timed steps, and more until `min_seconds` of them have run."""
        cuda = self.device.type == "cuda"
        times: list[list[float]] = [[] for _ in fns]
        i = 0
        while i < warmup + repeats or sum(map(sum, times)) < min_seconds:
            for fn, spent in zip(fns, times):
                if cuda:
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize(self.device)
                if i >= warmup:
                    spent.append(time.perf_counter() - t0)
            i += 1
        return [statistics.fmean(t) for t in times]  # the mean, as `strata bench latency` reports a step

    @torch.inference_mode()
    def retime(self, batches: tuple[int, ...] = PROBE_BATCHES, min_seconds: float = 0.0) -> DecodeTimes:
        """Time the probe's layers and head at each batch; `min_seconds`: keep timing each for at
        least that long (a window long enough to average the bandwidth's second-scale swings)."""
        layer_s, head_s = [], []
        for b in batches:
            inputs = (*self._step_inputs(b), self.kv_caches)
            hidden = self._decode(*inputs)
            # the head right after the layers, as in a step: timed alone in a loop, a head that
            # nearly fits the last-level cache (smol-135m int8: 28 MB of 32) read warm, 0.40 vs
            # 0.61 ms in the engine's step (Zen 5)
            layers, head = self._seconds(lambda inputs=inputs: self._decode(*inputs),
                                         lambda hidden=hidden: self.model.compute_logits(hidden).float(),
                                         min_seconds=min_seconds)
            layer_s.append(layers / self.layers)
            head_s.append(head)
        times = DecodeTimes(tuple(batches), tuple(layer_s), tuple(head_s), PROBE_CONTEXT, self.layers)
        logger.info("decode probe %s over %d layers at context %d: per layer %s ms, head %s ms (batches %s)",
                    self.cfg.architecture, self.layers, PROBE_CONTEXT,
                    [f"{x * 1e3:.3f}" for x in layer_s], [f"{x * 1e3:.2f}" for x in head_s], list(batches))
        return times


    @torch.inference_mode()
    def prefill_layer_s(self, tokens: int, min_seconds: float = 0.0) -> float:
        """Mean seconds per layer of one `tokens`-token prompt (no prior context) through the
        probe's layers: the engine's prefill forward, every built layer once per pass (timed for
        at least `min_seconds`)."""
        if not 1 <= tokens <= PREFILL_MAX_TOKENS:
            raise ValueError(f"tokens={tokens}: the probe times prompts of 1..{PREFILL_MAX_TOKENS} tokens")
        dev = self.device
        span = PrefillSpan(0, tokens, 0, torch.arange(-(-tokens // BLOCK), device=dev), None)
        meta = AttentionMetadata(slot_mapping=torch.arange(tokens, device=dev), prefills=[span],
                                 num_prefill_tokens=tokens, decode_block_tables=None, decode_mask=None,
                                 backend=self.backend)
        ids = torch.randint(3, self.cfg.vocab_size, (tokens,), device=dev)
        pos = torch.arange(tokens, device=dev)
        [seconds] = self._seconds(lambda: self.model(ids, pos, meta, self.kv_caches), warmup=PREFILL_WARMUP,
                                  repeats=PREFILL_REPEATS, min_seconds=min_seconds)
        logger.info("decode probe's model: %d-token prefill %.2f ms per layer over %d layers", tokens,
                    seconds / self.layers * 1e3, self.layers)
        return seconds / self.layers


def estimate_layer_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int) -> int:
    """Weight bytes of one decoder layer as the engine stores it."""
    one = dataclasses.replace(cfg, num_layers=1, tie_word_embeddings=True)
    none = dataclasses.replace(cfg, num_layers=0, tie_word_embeddings=True)
    return max(1, weight_bytes(one, dtype, quantization, group) - weight_bytes(none, dtype, quantization, group))


def probe_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int) -> int:
    """Memory the probe holds: its layers, embedding and head (as the engine stores them)."""
    layer = estimate_layer_bytes(cfg, dtype, quantization, group)
    built = dataclasses.replace(cfg, num_layers=layers_to_build(cfg, layer))
    return weight_bytes(built, dtype, quantization, group)


_PROBES: dict[tuple, DecodeProbe] = {}


def decode_probe(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int,
                 device: str = "cpu") -> DecodeProbe:
    """The probe for this shape and format, built once per process (`forget` drops them)."""
    key = (repr(cfg), dtype, quantization, group, device)
    if key not in _PROBES:
        _PROBES[key] = DecodeProbe(cfg, dtype, quantization, group, device)
    return _PROBES[key]


def forget() -> None:
    _PROBES.clear()


def plan_probe(cfg: ModelConfig, shape: ModelShape, dev: Device, dtype: torch.dtype, quantization: str | None,
               group: int, notes: list[str]) -> DecodeTimes | None:
    """`this` device's decode kernels timed for the plan, or None (rates) when building and timing
    them would take more time or memory than the budget; says which in `notes`."""
    held = probe_bytes(cfg, dtype, quantization, group)
    built = layers_to_build(cfg, estimate_layer_bytes(cfg, dtype, quantization, group))
    rate_s = sum(decode_step(shape, dev, b, PROBE_CONTEXT).kernel_s for b in PROBE_BATCHES)
    cost = held / 1e9 + 2 * (WARMUP + REPEATS + 1) * rate_s * built / cfg.num_layers  # ~1 GB/s to build
    room = (dev.available_bytes or 0) * DECODE_PROBE_MEMORY_SHARE
    if cost > DECODE_PROBE_BUDGET_S or held > room:
        why = (f"~{cost:.0f} s (budget {DECODE_PROBE_BUDGET_S:.0f} s)" if cost > DECODE_PROBE_BUDGET_S
               else f"{held / 2**30:.1f} GiB (more than {DECODE_PROBE_MEMORY_SHARE:.0%} of free memory)")
        notes.append(f"decode from the measured rates: timing the model's layers would take {why}; "
                     "the per-layer Python of the engine is then only in the calibrated overhead")
        return None
    times = decode_probe(cfg, dtype, quantization, group, dev.torch_device or "cpu").retime()
    notes.append(f"decode priced from the model's own layers timed here ({times.layers} of {cfg.num_layers} "
                 f"layers built in the engine's weight format, batches {list(times.batches)} at context "
                 f"{times.context}; decode_probe.py), the KV beyond that context at the memory bandwidth")
    return times


def whole_prompt_layer(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, group: int, dev: Device,
                       layer, probe: DecodeTimes, notes: list[str]):
    """The prefill layer probe's split (layer_probe.LayerTimes) scaled to the probe's model timed
    over the whole prompt: a pass through all its layers (up to all of the model's) varies far less
    on a shared VM than one layer over <= 4 copies, and sees what the forward adds around them."""
    cost = (PREFILL_WARMUP + PREFILL_REPEATS) * probe.layers * layer.layer_s
    if layer.tokens > PREFILL_MAX_TOKENS or cost > DECODE_PROBE_BUDGET_S:
        return layer
    model = decode_probe(cfg, dtype, quantization, group, dev.torch_device or "cpu")
    scaled = layer.scaled(model.prefill_layer_s(layer.tokens))
    notes.append(f"prefill layer times scaled to the model's {probe.layers} layers timed over a {layer.tokens}-token "
                 f"prompt ({scaled.layer_s * 1e3:.2f} vs {layer.layer_s * 1e3:.2f} ms per layer alone)")
    return scaled
