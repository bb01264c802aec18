"""`strata deploy render`: the Helm chart's values and manifests from a plan."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from strata.config import engine_default
from strata.deploy import sizing as sizing_mod
from strata.deploy.render import (
    ChartOptions,
    build_values,
    chart_dir,
    helm_available,
    render_manifests,
    write_outputs,
)
from strata.deploy.sizing import DeployRequest, size_deployment

NAME = "render"
HELP = "plan GPUs, tensor parallelism and KV cache; write values.yaml + manifests"
DESCRIPTION = sizing_mod.__doc__
EPILOG = """examples:
  strata deploy render --model ./Llama-2-7b-hf --hardware A100-80GB --max-model-len 4096 -o deploy/out/llama2
  strata deploy render --model ./Meta-Llama-3-70B/config.json --hardware H100x4 --max-model-len 8192 \\
      --concurrency 16 --explain -o deploy/out/llama3-70b
  strata deploy render --model ./Meta-Llama-3-70B --hardware H100x8 --max-nodes 2 --max-model-len 131072 -o out/
  strata deploy render --model smol-135m --hardware this --dtype float32 -o out/cpu   # a CPU pod like this machine
then:  helm install strata deploy/helm/strata -f OUT/values.yaml   (or kubectl apply -f OUT/manifests/)
"""


def run(args: argparse.Namespace) -> int:
    chart = chart_dir(args.chart)
    req = DeployRequest(
        model=args.model, hardware=args.hardware, replicas=args.replicas, max_model_len=args.max_model_len,
        quantization=args.quantization, dtype=args.dtype, concurrency=args.concurrency, max_nodes=args.max_nodes,
        gpu_memory_utilization=args.gpu_memory_utilization, cpus=args.cpus, drain_timeout=args.drain_timeout,
        pre_stop_seconds=args.pre_stop_seconds,
    )
    opts = ChartOptions(
        release=args.release, namespace=args.namespace, image=args.image, replicas=args.replicas,
        model_path=args.model_path, served_model_name=args.served_model_name, model_volume=args.model_volume,
        autoscaling=args.autoscaling, max_replicas=args.max_replicas, service_monitor=args.service_monitor,
        grafana_dashboard=args.grafana_dashboard, gpu_product=args.gpu_product,
    )
    sizing = size_deployment(req)
    values = build_values(sizing, opts, chart)
    why_not = helm_available()
    manifests = None if why_not else render_manifests(chart, values, opts.release, opts.namespace)
    out = Path(args.output)
    written = write_outputs(out, values, manifests, sizing)
    s = sizing
    where = (f"{s.gpus_per_replica} x {s.accelerator} per replica (TP={s.tensor_parallel_size}"
             + (f", {s.nodes_per_replica} pods" if s.nodes_per_replica > 1 else "") + ")"
             if s.device == "cuda" else f"CPU pod, {s.cpu} cores")
    print(f"{s.model}: {where}; KV cache {values['engine']['kvCacheMemory']} per rank = {s.kv_tokens} tokens "
          f"({s.max_sequences} sequences of {s.max_model_len}); pod {s.cpu} CPU, {values['resources']['memory']}; "
          f"drain {s.drain_timeout} s, grace {s.pre_stop_seconds + s.drain_timeout + 10} s")
    if args.explain:
        for r in s.reasons:
            print(f"  - {r}")
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    if why_not:
        print(f"manifests not rendered: {why_not}; or run: helm template {shlex.quote(opts.release)} "
              f"{shlex.quote(str(chart))} -n {shlex.quote(opts.namespace)} -f {shlex.quote(str(out / 'values.yaml'))}",
              file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF directory, config.json, or a random shape (smol-135m, ...)")
    p.add_argument("--hardware", default="this",
                   help="NAME or NAMExN (N GPUs per node, e.g. H100x4, L4) or 'this' (default; a CPU pod on a CPU box)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="where values.yaml, plan.json, manifests/ go")
    p.add_argument("--explain", action="store_true", help="print why each tensor-parallel degree was taken or not")
    g = p.add_argument_group("plan")
    g.add_argument("--replicas", type=int, default=1, help="server pods (each with its engine)")
    g.add_argument("--max-model-len", type=int, default=None, help="L (default: the model's max positions)")
    g.add_argument("--quantization", default=None, choices=["int8", "int4", "bf16"],
                   help="weight-only quantisation, as the engine flag")
    g.add_argument("--dtype", default=engine_default("dtype"), help="auto (the checkpoint's on GPUs) | float32 | "
                   "bfloat16 | float16; the resolved dtype is passed to the server")
    g.add_argument("--concurrency", type=int, default=16,
                   help="sequences of max_model_len each replica's KV cache must hold at once (default 16)")
    g.add_argument("--max-nodes", type=int, default=1, help="nodes one replica may span (default 1)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="share of each GPU's memory for weights + activations + KV (default 0.90)")
    g.add_argument("--cpus", type=int, default=None, help="CPU pods: cores per pod (default: this machine's)")
    g.add_argument("--drain-timeout", type=int, default=None, help="seconds (default: from the plan)")
    g.add_argument("--pre-stop-seconds", type=int, default=10, help="preStop sleep before SIGTERM (default 10)")
    c = p.add_argument_group("chart")
    c.add_argument("--chart", default=None, help="chart directory (default: this checkout's deploy/helm/strata)")
    c.add_argument("--release", default="strata", help="Helm release name (default strata)")
    c.add_argument("--namespace", default="default", help="Kubernetes namespace of the release")
    c.add_argument("--image", default=None, help="REPOSITORY:TAG (default strata:0.1.0-cuda or strata:0.1.0-cpu)")
    c.add_argument("--model-volume", default="pvc:strata-models", help="pvc:CLAIM or hostPath:/DIR, mounted read-only")
    c.add_argument("--model-path", default=None, help="the model directory inside the container "
                   "(default /models/<model dir name>)")
    c.add_argument("--served-model-name", default=None, help="model id clients use (default: the model's name)")
    c.add_argument("--autoscaling", default="off", choices=["off", "keda", "hpa"],
                   help="scale on waiting requests: KEDA ScaledObject or HPA on a custom metric (default off)")
    c.add_argument("--max-replicas", type=int, default=4, help="autoscaling ceiling (default 4)")
    c.add_argument("--service-monitor", action="store_true", help="a Prometheus Operator ServiceMonitor for /metrics")
    c.add_argument("--grafana-dashboard", action="store_true", help="the dashboard as a ConfigMap for Grafana's sidecar")
    c.add_argument("--gpu-product", default="", help="node label nvidia.com/gpu.product to schedule on, e.g. "
                   "NVIDIA-H100-80GB-HBM3")
