"""The chart's values from a Sizing, checked against values.schema.json, and the manifests rendered.

The values file is complete (the chart's defaults with the plan's fields merged in), so it
validates against the schema on its own and `helm install -f` needs nothing else. Manifests are
rendered by Helm itself (helm-python-sdk: Helm's Go engine as a library, offline) when it is
installed (`pip install 'strata[deploy]'`); without it the values are written and the exact
`helm template` command is printed instead: Strata does not reimplement Go templates.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from strata.deploy.sizing import GiB, MiB, Sizing
from strata.errors import ConfigError

CHECKOUT_CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "strata"


@dataclass(frozen=True)
class ChartOptions:
    """What the plan does not decide: where the image and the model are, and the optional parts."""

    release: str = "strata"
    namespace: str = "default"
    image: str | None = None  # REPO:TAG; default strata:0.1.0-cuda / strata:0.1.0-cpu
    replicas: int = 1
    model_path: str | None = None  # inside the container; default /models/<model dir name>
    served_model_name: str | None = None
    model_volume: str = "pvc:strata-models"  # pvc:CLAIM | hostPath:/DIR
    autoscaling: str = "off"  # off | keda | hpa
    max_replicas: int = 4
    service_monitor: bool = False
    grafana_dashboard: bool = False
    gpu_product: str = ""


def chart_dir(path: str | None) -> Path:
    """--chart, else the checkout's deploy/helm/strata (the chart ships in the repository)."""
    d = Path(path).expanduser() if path else CHECKOUT_CHART
    if not (d / "Chart.yaml").is_file():
        raise ConfigError(f"--chart {d}: no Chart.yaml there; pass --chart PATH/TO/deploy/helm/strata "
                          "(the chart is in Strata's repository, not in the wheel)")
    return d


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _quantity(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity, rounded up to GiB (or MiB below 1 GiB)."""
    if nbytes >= GiB:
        return f"{-(-nbytes // GiB)}Gi"
    return f"{-(-nbytes // MiB)}Mi"


def _model_name(model: str) -> str:
    p = Path(model)
    if p.name == "config.json" or p.suffix == ".json":
        return p.parent.name if p.name == "config.json" else p.stem
    return p.name or model


def _volume(spec: str) -> dict[str, Any]:
    kind, _, where = spec.partition(":")
    if kind == "pvc" and where:
        return {"type": "pvc", "claimName": where}
    if kind == "hostPath" and where.startswith("/"):
        return {"type": "hostPath", "hostPath": where}
    raise ConfigError(f"--model-volume {spec!r}: expected pvc:CLAIM_NAME or hostPath:/ABSOLUTE/DIR")


def plan_values(s: Sizing, opts: ChartOptions) -> dict[str, Any]:
    """The values the plan and the options set (merged over the chart's defaults by build_values)."""
    if opts.autoscaling not in ("off", "keda", "hpa"):
        raise ConfigError(f"--autoscaling {opts.autoscaling!r}: choose off, keda or hpa")
    if opts.autoscaling != "off" and s.nodes_per_replica > 1:
        raise ConfigError("--autoscaling with a replica spanning nodes (LeaderWorkerSet) is not supported; "
                          "scale the LeaderWorkerSet's replicas yourself (--replicas)")
    name = _model_name(s.model)
    repo, _, tag = (opts.image or f"strata:0.1.0-{'cuda' if s.device == 'cuda' else 'cpu'}").rpartition(":")
    if not repo or not tag or "/" in tag:
        raise ConfigError(f"--image {opts.image!r}: expected REPOSITORY:TAG, e.g. ghcr.io/me/strata:0.1.0-cuda")
    cuda = s.device == "cuda"
    values: dict[str, Any] = {
        "image": {"repository": repo, "tag": tag},
        "replicas": opts.replicas,
        "model": {"path": opts.model_path or f"/models/{name}", "servedName": opts.served_model_name or name,
                  "volume": _volume(opts.model_volume)},
        "engine": {
            "device": s.device, "dtype": s.dtype, "tensorParallelSize": s.tensor_parallel_size,
            "maxModelLen": s.max_model_len, "kvCacheMemory": f"{s.kv_cache_memory // MiB}MiB",
            "quantization": s.quantization or "", "threads": s.threads,
        },
        "server": {"drainTimeoutSeconds": s.drain_timeout, "preStopSleepSeconds": s.pre_stop_seconds,
                   "startupTimeoutSeconds": s.startup_seconds},
        "gpu": {"count": s.gpus_per_pod, "product": opts.gpu_product},
        "multiNode": {"enabled": s.nodes_per_replica > 1, "size": s.nodes_per_replica},
        "resources": {"cpu": s.cpu, "memory": _quantity(s.memory)},
        "shm": {"sizeLimit": _quantity(s.shm)},
        "autoscaling": {"enabled": opts.autoscaling != "off", "kind": "hpa" if opts.autoscaling == "hpa" else "keda",
                        "minReplicas": max(1, opts.replicas), "maxReplicas": max(opts.max_replicas, opts.replicas)},
        "serviceMonitor": {"enabled": opts.service_monitor},
        "grafanaDashboard": {"enabled": opts.grafana_dashboard},
        "plan": {
            "hardware": f"{s.accelerator}" + (f" x{s.gpus_per_replica}" if cuda else ""),
            "tensor-parallel-size": str(s.tensor_parallel_size),
            "gpus-per-replica": str(s.gpus_per_replica),
            "kv-cache-memory": f"{s.kv_cache_memory // MiB}MiB",
            "kv-tokens": str(s.kv_tokens),
            "max-sequences": str(s.max_sequences),
            "concurrency": str(s.concurrency),
            "predicted-tpot-ms": f"{s.predicted_tpot_s * 1e3:.1f}",
        },
    }
    return values


def build_values(s: Sizing, opts: ChartOptions, chart: Path) -> dict[str, Any]:
    """The complete values file: chart defaults + the plan's, validated against values.schema.json."""
    defaults = yaml.safe_load((chart / "values.yaml").read_text())
    values = _merge(defaults, plan_values(s, opts))
    validate_values(values, chart)
    return values


def validate_values(values: dict[str, Any], chart: Path) -> None:
    schema = json.loads((chart / "values.schema.json").read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.path) or "(top level)"
        raise ConfigError(f"values {where}: {e.message} (values.schema.json)")


def helm_available() -> str | None:
    """None when Helm's engine can be loaded here, else why not."""
    try:
        import helm_python  # noqa: F401
    except (ImportError, OSError) as e:
        return f"helm-python-sdk is not installed ({e}); pip install 'strata[deploy]'"
    return None


def render_manifests(chart: Path, values: dict[str, Any], release: str, namespace: str) -> dict[str, str]:
    """Template path -> rendered YAML (empty templates dropped), by Helm's own engine."""
    import helm_python as helm

    try:
        with helm.Chart.load(str(chart)) as c:
            out = c.render(values, name=release, namespace=namespace, is_install=True)
    except helm.HelmError as e:
        raise ConfigError(f"helm could not render {chart}: {e}") from None
    return {k: v for k, v in out.items() if v.strip() and not k.endswith("NOTES.txt")}


def write_outputs(out: Path, values: dict[str, Any], manifests: dict[str, str] | None, sizing: Sizing) -> list[Path]:
    """DIR/values.yaml, DIR/plan.json and, when rendered, DIR/manifests/<template>.yaml."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    header = "# written by `strata deploy render`; every engine and resources field comes from the plan\n"
    (out / "values.yaml").write_text(header + yaml.safe_dump(values, sort_keys=False))
    written.append(out / "values.yaml")
    summary = {**sizing.summary(), "reasons": sizing.reasons}
    (out / "plan.json").write_text(json.dumps(summary, indent=2) + "\n")
    written.append(out / "plan.json")
    if manifests is not None:
        mdir = out / "manifests"
        mdir.mkdir(exist_ok=True)
        for old in mdir.glob("*.yaml"):
            old.unlink()
        for name, text in sorted(manifests.items()):
            path = mdir / Path(name).name
            path.write_text(text.lstrip("\n"))
            written.append(path)
    return written
