"""`strata bench plan-accuracy`: the planner's predictions against `strata bench latency`, measured now.

For each model (random weights, fp32 by default): re-measure this machine (`strata hw --refresh`
and the step-overhead calibration: the DRAM bandwidth of a shared VM moves within minutes, so the
prediction must see the machine the measurement sees), build `strata plan` for `this`, then run
`strata bench latency` for the three cases and print every predicted/measured pair:

  batch-1 decode tok/s   128-token prompt, 128 output tokens   (target: within 10%)
  512-token prefill ms   batch 1, 8 output tokens              (target: within 10%)
  batch-16 decode tok/s  128-token prompt, 64 output tokens    (target: within 20%)

`--quantization bf16|int8|int4` checks the other weight paths the same way (bf16 weights with fp32
compute; int8/int4 with their VNNI integer kernels where the CPU has them).

Decode is predicted at the mean context the measured steps attend over (prompt + output / 2).
On the dev VM the memory bandwidth drifts between ~25 and ~40 GB/s within minutes, more than the
tolerance, so a prediction from figures taken earlier would test the drift, not the planner: the
plan's decode probe (decode_probe.py: the model's own layers timed at its shapes) is re-timed for
RETIME_S at the case's batch just before and just after each run and the two averaged ("probe
ms/layer": the per-layer time used);
for the prefill pair its model is timed over the 512-token prompt the same way and the plan's
layer split is scaled to that.
Where the plan priced decode from the rates (no probe), the weight-streaming rate is re-measured
the same way instead (the median GEMV rate over a second; "GEMV GB/s").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from strata.bench.common import write_json
from strata.text_table import print_table

NAME = "plan-accuracy"
HELP = "strata plan's predictions vs strata bench latency, measured in one run"

# Seconds each re-timing runs (before and after a measured run, at the case's batch only): the
# VM's bandwidth swings ~1.5x within seconds, and 7 batch-1 steps (70-140 ms) sampled one swing,
# so the same probe read 1.56-2.79 ms a qwen-0.5b layer in one minute (Zen 4).
RETIME_S = 2.0

# (case, batch, input_len, output_len, target relative error)
CASES = [
    ("batch-1 decode", 1, 128, 128, 0.10),
    ("512-token prefill", 1, 512, 8, 0.10),
    ("batch-16 decode", 16, 128, 64, 0.20),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None,
                   help="random shape (smol-135m, qwen-0.5b, tiny) or HF directory; repeatable "
                        "(default: smol-135m and qwen-0.5b)")
    p.add_argument("--dtype", default="float32", help="dtype of both runs")
    p.add_argument("--quantization", default=None, choices=["bf16", "int8", "int4"],
                   help="the weight path to check (default: the dtype's own weights)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the pairs as JSON")


def _measure(model: str, dtype: str, quantization: str | None, batch: int, input_len: int,
             output_len: int) -> dict:
    """One `strata bench latency` run in a child process (its own memory, as a user would run it)."""
    source = ["--random-model", model] if not Path(model).exists() else ["--model", model]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "latency.json"
        cmd = [sys.executable, "-m", "strata", "bench", "latency", *source, "--dtype", dtype,
               "--batch", str(batch), "--input-len", str(input_len), "--output-len", str(output_len),
               "--json", str(out), *(["--quantization", quantization] if quantization else [])]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["strata"]


def _stream_now(dtype: str, quantization: str | None, seconds: float = 1.0) -> float:
    """Median batch-1 GEMV rate (GB/s of weights) over `seconds`, through the kernels the engine
    runs for this weight path (the rate the profile holds for it: linear_gbs or quant_linear_gbs)."""
    import statistics
    import time

    import torch

    from strata.hardware.measure import CPU_LINEAR_SHAPE, QUANT_LINEAR_SHAPE
    from strata.kernels import cpu_quant
    from strata.kernels.linear import linear

    with torch.inference_mode():
        if quantization in ("int8", "int4"):
            n, k = QUANT_LINEAR_SHAPE
            cols = k if quantization == "int8" else 2 * k
            if quantization == "int8":
                w, s = torch.randint(-127, 128, (n, cols), dtype=torch.int8).numpy(), torch.rand(n).numpy()
            else:
                w = torch.randint(0, 256, (n, cols // 2), dtype=torch.uint8).numpy()
                s = torch.rand(n, cols // 64).numpy()
            x = torch.randn(1, cols)
            nbytes = w.nbytes + s.nbytes

            def call():
                return cpu_quant.gemv(quantization, x, w, s, 64)
        else:
            w = torch.randn(*CPU_LINEAR_SHAPE).to(torch.bfloat16 if quantization == "bf16" else getattr(torch, dtype))
            x = torch.randn(1, w.shape[1], dtype=w.dtype)
            nbytes = w.numel() * w.element_size()

            def call():
                return linear(x, w)
        call()
        rates, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(rates) < 5:
            t0 = time.perf_counter()
            call()
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def _measure_with_drift(plan, model: str, args: argparse.Namespace, batch: int, n_in: int, n_out: int,
                        prefill_case: bool):
    """(measured, None, GEMV GB/s): the run with the weight-streaming rate re-measured just before
    and after (the mean), for predictions from the rates (no decode probe) and for prefill."""
    cpu = plan.device.kind == "cpu"  # the drift re-measurement is a CPU GEMV
    before = _stream_now(plan.dtype, args.quantization) if cpu else plan.device.stream_gbs
    got = _measure(model, args.dtype, args.quantization, batch, n_in, n_out)
    stream = (before + _stream_now(plan.dtype, args.quantization)) / 2 if cpu else before
    if prefill_case:  # compute-bound: the plan's own figures
        stream = plan.device.stream_gbs
    return got, None, stream


def _probe_model(plan, cfg, args: argparse.Namespace):
    """The plan's probe model (decode_probe.py; built once per process, so re-timing is cheap)."""
    import torch

    from strata.analyze.decode_probe import decode_probe
    from strata.config import engine_default

    return decode_probe(cfg, getattr(torch, plan.dtype), args.quantization, engine_default("quantization_group_size"),
                        plan.device.torch_device or "cpu")


def _retime(plan, cfg, args: argparse.Namespace, batch: int):
    return _probe_model(plan, cfg, args).retime((batch,), min_seconds=RETIME_S)


def _prefill_layer_now(plan, cfg, args: argparse.Namespace) -> float:
    return _probe_model(plan, cfg, args).prefill_layer_s(plan.prefill_layer.tokens, min_seconds=RETIME_S)


def _mean_times(a, b):
    return dataclasses.replace(a, layer_s=tuple((x + y) / 2 for x, y in zip(a.layer_s, b.layer_s)),
                               head_s=tuple((x + y) / 2 for x, y in zip(a.head_s, b.head_s)))


def _predict(model: str, dtype: str, quantization: str | None):
    from strata.analyze.plan import PlanRequest, build_plan

    req = PlanRequest(model=model, dtype=dtype, quantization=quantization, batch=16, input_len=512, context=192, max_model_len=2048,
                      refresh=True)
    return build_plan(req)


def main(args: argparse.Namespace) -> int:
    from strata.analyze.cost_model import ModelShape, decode_step, prefill
    from strata.analyze.plan import resolve_model
    from strata.config import engine_default

    models = args.model or ["smol-135m", "qwen-0.5b"]
    rows, pairs = [], []
    for model in models:
        print(f"{model}: measuring this machine and planning ...", flush=True)
        plan = _predict(model, args.dtype, args.quantization)
        cfg, _ = resolve_model(model)
        import torch

        shape = ModelShape.of(cfg, getattr(torch, plan.dtype), args.quantization,
                              engine_default("quantization_group_size"))
        for case, batch, n_in, n_out, target in CASES:
            print(f"{model}: strata bench latency, {case} ...", flush=True)
            prefill_case = case.endswith("prefill")
            prefill_s, layer_ms = plan.prefill.total_s, None
            if prefill_case and plan.decode_probe is not None and plan.prefill_layer is not None:
                # the probe's model timed over the prompt just before and after, as for decode
                before = _prefill_layer_now(plan, cfg, args)
                got = _measure(model, args.dtype, args.quantization, batch, n_in, n_out)
                now = (before + _prefill_layer_now(plan, cfg, args)) / 2
                layer_ms = now * 1e3
                prefill_s = prefill(shape, plan.device, n_in, engine_default("max_num_batched_tokens"), 1,
                                    plan.overhead, plan.prefill_layer.scaled(now)).total_s
                probe, stream = None, plan.device.stream_gbs
            elif prefill_case or plan.decode_probe is None:
                got, probe, stream = _measure_with_drift(plan, model, args, batch, n_in, n_out, prefill_case)
            else:  # the model's layers timed again just before and just after the run, averaged
                before = _retime(plan, cfg, args, batch)
                got = _measure(model, args.dtype, args.quantization, batch, n_in, n_out)
                probe = _mean_times(before, _retime(plan, cfg, args, batch))
                stream = plan.device.stream_gbs
            if prefill_case:
                predicted, measured, unit = prefill_s * 1e3, got["prefill_s"] * 1e3, "ms"
            else:
                drift = stream / plan.device.stream_gbs
                dev = dataclasses.replace(plan.device, stream_gbs=stream, mem_gbs=plan.device.mem_gbs * drift)
                step = decode_step(shape, dev, batch, n_in + n_out // 2, 1, plan.overhead, probe)
                predicted, measured, unit = step.tokens_per_s, got["decode_tokens_per_s"], "tok/s"
            if not prefill_case:
                layer_ms = probe.at(batch)[0] * 1e3 if probe is not None else None
            error = predicted / measured - 1
            ok = abs(error) <= target
            pairs.append(dict(model=model, case=case, unit=unit, predicted=predicted, measured=measured,
                              error=error, target=target, ok=ok, stream_gbs=stream, probe_layer_ms=layer_ms))
            rows.append([model, case, unit, predicted, measured, f"{error:+.1%}", f"±{target:.0%}",
                         "yes" if ok else "NO", "-" if layer_ms is None else layer_ms, stream])
        from strata.analyze.decode_probe import forget

        forget()  # this model's probe layers: freed before the next model's
    print()
    print_table(["model", "case", "unit", "predicted", "measured", "error", "target", "within",
                 "probe ms/layer", "GEMV GB/s"], rows)
    held = sum(p["ok"] for p in pairs)
    path = args.dtype + (f" + {args.quantization} weights" if args.quantization else "")
    print(f"\n{held}/{len(pairs)} pairs within target ({path}; predictions from `strata plan --hardware this`)")
    write_json(args.json, {"dtype": args.dtype, "quantization": args.quantization, "pairs": pairs})
    return 0
