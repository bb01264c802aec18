"""What a Strata decode step costs beyond moving bytes and doing FLOPs, measured (and cached).

A decode step is not only GEMVs: there is Python per layer (module calls, kernel dispatch, norms,
rotary, attention bookkeeping) and per step (scheduler, runner tensors, sampler). Those costs do
not scale with the weights, so they are measured directly: the real engine decodes with
random-weight models too small for bytes or FLOPs to matter (hidden 64), at two depths and a few
batch sizes. Whatever the kernel model (plan.py) does not explain in those steps is the
overhead: per-layer = the slope between the two depths, per-step = the rest. Linear in batch
between the measured batch sizes.

Every other decode step runs with cold caches (a buffer twice the last-level cache read before
it, untimed): in a real step the weight stream has evicted the interpreter's working set, and
its Python runs 3-5x slower than warm. The per-step overhead is taken from the cold steps; the
per-layer slope from the warm ones (cold, it would count the tiny layers' own cache misses,
which the decode probe's layer times already hold for the real model). Measured all warm, the
overhead was a seventh of the engine's (smol-135m int8 batch 1 on a Zen 5: 0.046 ms calibrated
vs 0.35 ms profiled), so short steps were predicted 10-16% too fast.

Multi-step decode (platform/multi_step.py) pays part of that once per scheduler call: the engines
are timed at one step per call and again at MULTI_STEPS per call (each later step also after the
eviction read, untimed: in a real run the weights stream between them too), and `at` takes the
per-step overhead at K steps per call as a + b/K through those two points; `steps_per_call` is the
count the engine's automatic rule picks for a step of a given length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from strata.config import EngineConfig, cache_root
from strata.demo.random_models import random_state_dict
from strata.engine.llm_engine import LLMEngine
from strata.hardware.host_facts import cpu_caches
from strata.hardware.probe import _cpu_info
from strata.model_config import ModelConfig
from strata.platform.multi_step import steps_for
from strata.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SCHEMA = 4  # 2: residuals after the decode probe's kernel times (plan.py); 3: timed with cold caches;
# 4: per-step overhead at MULTI_STEPS (8) steps per call too
DEPTHS = (2, 10)
BATCHES = (1, 16, 64)
PROMPT_LEN = 32
DECODE_STEPS = 24
# steps per call of the multi-step timing: the two points a + b/K goes through are K = 1 and this
MULTI_STEPS = 8
SHAPE = {  # tiny: ~0.1 MB of weights per layer, L2-resident; only the fixed costs remain
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass(frozen=True)
class StepOverhead:
    """Seconds per decode step not explained by bytes and FLOPs: per_step + per_layer x layers,
    each linear in batch between the measured batch sizes."""

    batches: list[int]
    per_step_s: list[float]
    per_layer_s: list[float]
    measured: dict[str, float]  # "layers=L,batch=B" -> measured median step seconds (tiny model)
    device: str
    dtype: str
    quantization: str | None
    # per decode step at MULTI_STEPS steps per scheduler call (CPU; None: not measured)
    per_step_multi_s: list[float] | None = None

    def at(self, batch: int, layers: int, steps: int = 1) -> float:
        """Seconds a decode step of `batch` rows costs beyond its kernels, with `steps` decode steps
        per scheduler call (multi-step decode): a + b / steps through the two measured counts."""
        one = _interp(self.batches, self.per_step_s, batch)
        per_step = one
        if steps > 1 and self.per_step_multi_s:
            b = (one - _interp(self.batches, self.per_step_multi_s, batch)) / (1 - 1 / MULTI_STEPS)
            per_step = one - b + b / steps
        return max(0.0, per_step + layers * _interp(self.batches, self.per_layer_s, batch))

    def steps_per_call(self, step_s: float) -> int:
        """Decode steps per scheduler call the engine picks for steps of `step_s` (platform/multi_step.py;
        1 where it does not run several: no multi-step measurement, i.e. not CPU)."""
        if not self.per_step_multi_s:
            return 1
        return steps_for(step_s)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> StepOverhead:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"overhead schema {d.get('schema')!r} != {SCHEMA}")
        return cls(
            batches=[int(b) for b in d["batches"]], per_step_s=[float(x) for x in d["per_step_s"]],
            per_layer_s=[float(x) for x in d["per_layer_s"]],
            measured={str(k): float(v) for k, v in d["measured"].items()}, device=str(d["device"]),
            dtype=str(d["dtype"]), quantization=d["quantization"],
            per_step_multi_s=None if d.get("per_step_multi_s") is None else [float(x) for x in d["per_step_multi_s"]],
        )

    @classmethod
    def zero(cls, device: str = "none", dtype: str = "float32") -> StepOverhead:
        return cls([1], [0.0], [0.0], {}, device, dtype, None)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in x, extended linearly past the ends."""
    if len(xs) == 1:
        return ys[0]
    for i in range(len(xs) - 1):
        if x <= xs[i + 1] or i == len(xs) - 2:
            x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def _checkpoint(layers: int) -> Path:
    """A random-weight checkpoint of SHAPE with `layers` layers, written once under the cache."""
    from safetensors.torch import save_file

    cfg = dict(SHAPE, num_hidden_layers=layers, torch_dtype="float32")
    out = cache_root() / f"calib-{layers}l"
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(random_state_dict(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _eviction_buffer() -> torch.Tensor:
    """A buffer twice the last-level cache (64 MiB where sysfs does not say), capped at 512 MiB."""
    caches = cpu_caches()
    last = caches[max(caches)] if caches else None
    size = 2 * last["bytes"] * last["instances"] if last else 64 * 2**20
    return torch.ones(min(size, 512 * 2**20) // 4, dtype=torch.float32)


def _decode_step_seconds(engine, batch: int, evict: torch.Tensor | None = None) -> tuple[float, float]:
    """Seconds of a decode step with `batch` sequences (prefill steps excluded), (warm, cold): the
    means, as `strata bench latency` reports a step and the decode probe (decode_probe.py) times
    its kernels, so that what is left after subtracting the probe's times is the engine's own
    work. Every other scheduler call runs after `evict` was read (cold), and so does each later
    step of a cold call (multi-step decode; those reads are not timed); without it both are all
    calls. A call of several steps counts as that many steps of its mean time."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)
    for i in range(batch):
        ids = [3 + (7 * i + j) % (SHAPE["vocab_size"] - 3) for j in range(PROMPT_LEN)]
        engine.add_request(f"calib-{batch}-{i}", None, ids, params)
    runner = engine.runner
    execute_next, own = runner.execute_next, vars(runner).get("execute_next")
    evicting = [False, 0.0]  # (this call is cold, seconds spent evicting inside it)

    def cold_next(*args):
        if evicting[0]:
            t = time.perf_counter()
            evict.sum()
            evicting[1] += time.perf_counter() - t
        return execute_next(*args)

    runner.execute_next = cold_next
    times, cold, steps = [], [], []
    try:
        while engine.has_unfinished():
            cold.append(evict is not None and len(times) % 2 == 1)
            if cold[-1]:
                evict.sum()  # the caches cold, as a real step's weight stream leaves them
            evicting[:] = [cold[-1], 0.0]
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0 - evicting[1])
            steps.append(engine.last_schedule.num_steps)
    finally:
        if own is None:
            del runner.execute_next  # the method again
        else:
            runner.execute_next = own
    first = -(-batch * PROMPT_LEN // engine.config.max_num_batched_tokens) + 1  # after the prefill

    def mean(want_cold: bool) -> float | None:
        pairs = [(t, n) for t, c, n in zip(times[first:], cold[first:], steps[first:]) if c == want_cold]
        return sum(t for t, _ in pairs) / sum(n for _, n in pairs) if pairs else None

    warm = mean(False) or sum(times) / sum(steps)
    return warm, mean(True) or warm


def measure_overhead(
    device: str, dtype: torch.dtype, quantization: str | None,
    kernel_seconds: Callable[[object, int, int], float],
) -> StepOverhead:
    """Measure the engine on the tiny models; `kernel_seconds(cfg, batch, context)` is the plan's
    own prediction of the bytes-and-FLOPs part, subtracted from each measured step."""
    dname = str(dtype).replace("torch.", "")
    multi = device == "cpu"  # where the engine runs several decode steps per call (platform/multi_step.py)
    measured: dict[str, float] = {}
    residual: dict[tuple[int, int, bool], float] = {}
    t0 = time.perf_counter()
    evict = _eviction_buffer() if device == "cpu" else None
    for layers in DEPTHS:
        path = _checkpoint(layers)
        engine = LLMEngine(EngineConfig(
            model=str(path), dtype=dname, device=device, max_model_len=PROMPT_LEN + DECODE_STEPS + 8,
            max_num_seqs=max(BATCHES), kv_cache_memory=max(BATCHES) * 8 * 2**20 // 64 + 2**20,
            quantization=quantization, enable_prefix_caching=False, num_threads=torch.get_num_threads(),
            num_scheduler_steps=1,  # one step per call: each timed call is one decode step
        ))
        cfg = ModelConfig.from_file(path / "config.json")
        _decode_step_seconds(engine, 1)  # warm-up: kernels compiled, pages touched
        for batch in BATCHES:
            runs = [_decode_step_seconds(engine, batch, evict) for _ in range(2)]
            kernels = kernel_seconds(cfg, batch, PROMPT_LEN + DECODE_STEPS // 2)
            for cold, label in ((False, ",warm"), (True, "")):
                sec = statistics.fmean(r[cold] for r in runs)
                measured[f"layers={layers},batch={batch}{label}"] = sec
                residual[layers, batch, cold] = sec - kernels
            if multi and layers == DEPTHS[0]:
                engine.policy.lookahead = MULTI_STEPS
                sec = statistics.fmean(_decode_step_seconds(engine, batch, evict)[1] for _ in range(2))
                engine.policy.lookahead = 1
                measured[f"layers={layers},batch={batch},steps={MULTI_STEPS}"] = sec
                residual[layers, batch, MULTI_STEPS] = sec - kernels
        del engine
    lo, hi = DEPTHS
    per_layer = [max(0.0, (residual[hi, b, False] - residual[lo, b, False]) / (hi - lo)) for b in BATCHES]
    per_step = [max(0.0, residual[lo, b, True] - lo * pl) for b, pl in zip(BATCHES, per_layer)]
    per_step_multi = [max(0.0, residual[lo, b, MULTI_STEPS] - lo * pl) for b, pl in zip(BATCHES, per_layer)] \
        if multi else None
    logger.info("step overhead measured in %.1f s: per step %s ms, per layer %s ms (batches %s)",
                time.perf_counter() - t0, [f"{x * 1e3:.2f}" for x in per_step],
                [f"{x * 1e3:.3f}" for x in per_layer], list(BATCHES))
    return StepOverhead(list(BATCHES), per_step, per_layer, measured, device, dname, quantization, per_step_multi)


def _cache_path(device: str, dtype: str, quantization: str | None) -> Path:
    ident = {
        "schema": SCHEMA, "device": device, "dtype": dtype, "quantization": quantization,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": _cpu_info()[0],
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f"step-overhead-{key}.json"


def step_overhead(
    device: str, dtype: torch.dtype, quantization: str | None,
    kernel_seconds: Callable[[object, int, int], float], refresh: bool = False,
) -> StepOverhead:
    """Cached `measure_overhead` (keyed by device, dtype, quantisation, threads, torch, CPU)."""
    dname = str(dtype).replace("torch.", "")
    path = _cache_path(device, dname, quantization)
    if not refresh:
        try:
            return StepOverhead.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable overhead cache %s (%s)", path, e)
    result = measure_overhead(device, dtype, quantization, kernel_seconds)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result.to_json(), indent=2))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache step overhead at %s: %s", path, e)
    return result
