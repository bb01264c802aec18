"""The Helm chart (deploy/helm/strata), rendered by Helm's engine for a matrix of values: every
object validates (Kubernetes schemas, strict), the values validate against values.schema.json,
and the policies hold: GPUs only in limits, probes on real routes, grace >= preStop + drain,
non-root with a read-only root filesystem."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.manifests import (
    CHART,
    helm,
    kinds,
    merged,
    pod_specs,
    render,
    validate_object,
    validate_values,
)

GPU = {"image": {"tag": "0.1.0-cuda"}, "engine": {"device": "cuda", "dtype": "float16", "kvCacheMemory": "60650MiB"}}


def _gpu(count: int, tp: int, **more) -> dict:
    v = merged({**GPU, "gpu": {"count": count}, "engine": {**GPU["engine"], "tensorParallelSize": tp},
                "resources": {"cpu": 2 + 2 * count, "memory": f"{6 + count}Gi"}})
    for k, val in more.items():
        v[k] = {**v[k], **val} if isinstance(val, dict) else val
    return v


CASES = {
    "default": merged({}),
    "cpu": merged({"resources": {"cpu": 8, "memory": "24Gi"}, "engine": {"maxModelLen": 4096}}),
    "gpu1": _gpu(1, 1),
    "tp2-one-node": _gpu(2, 2, shm={"sizeLimit": "4Gi"}),
    "tp4-two-nodes": _gpu(2, 4, multiNode={"enabled": True, "size": 2, "masterPort": 29500}),
    "autoscaling-keda": _gpu(1, 1, autoscaling={"enabled": True, "kind": "keda"}),
    "autoscaling-hpa": _gpu(1, 1, autoscaling={"enabled": True, "kind": "hpa"}),
    "monitoring-and-key": _gpu(1, 1, serviceMonitor={"enabled": True, "interval": "15s", "labels": {"release": "kps"}},
                               grafanaDashboard={"enabled": True, "labels": {"grafana_dashboard": "1"}},
                               server={"apiKeySecret": {"name": "strata-key", "key": "api-key"}}),
}
EXPECTED_KINDS = {
    "default": {"Deployment", "Service", "PodDisruptionBudget"},
    "cpu": {"Deployment", "Service", "PodDisruptionBudget"},
    "gpu1": {"Deployment", "Service", "PodDisruptionBudget"},
    "tp2-one-node": {"Deployment", "Service", "PodDisruptionBudget"},
    "tp4-two-nodes": {"LeaderWorkerSet", "Service", "PodDisruptionBudget"},
    "autoscaling-keda": {"Deployment", "Service", "PodDisruptionBudget", "ScaledObject"},
    "autoscaling-hpa": {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"},
    "monitoring-and-key": {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "ConfigMap"},
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in CASES.items()}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _serve_args(container: dict) -> list[str]:
    if container["command"] == ["strata"]:
        return container["args"]
    assert container["command"] == ["sh", "-c"]  # LeaderWorkerSet: torchrun "$@"
    return container["args"][2:]


@pytest.mark.parametrize("case", CASES)
def test_values_and_every_manifest_validate(case, rendered) -> None:
    validate_values(CASES[case])
    docs = rendered[case]
    assert {d["kind"] for d in docs} == EXPECTED_KINDS[case]
    for d in docs:
        validate_object(d)


def test_defaults_render_without_values() -> None:
    docs = render(None)
    assert {d["kind"] for d in docs} == EXPECTED_KINDS["default"]
    for d in docs:
        validate_object(d)


@pytest.mark.parametrize("case", CASES)
def test_gpus_only_in_limits(case, rendered) -> None:
    gpus = CASES[case]["gpu"]["count"]
    for spec in pod_specs(rendered[case]):
        for c in spec["containers"]:
            res = c["resources"]
            assert "nvidia.com/gpu" not in res["requests"]
            assert res["limits"].get("nvidia.com/gpu") == (str(gpus) if gpus else None)
            assert res["requests"] == {k: v for k, v in res["limits"].items() if k != "nvidia.com/gpu"}  # Guaranteed
            args = _serve_args(c)
            assert _arg(args, "--device") == ("cuda" if gpus else "cpu")
            if not gpus:
                assert _arg(args, "--threads") == str(CASES[case]["resources"]["cpu"])  # threads = CPU limit
                assert "tolerations" not in spec


def _route_paths() -> set[str]:
    from strata.server import routes_ops

    return {r.path for r in routes_ops.router.routes}


@pytest.mark.parametrize("case", CASES)
def test_probes_point_at_existing_routes_and_cover_the_load(case, rendered) -> None:
    routes = _route_paths()
    values = CASES[case]
    for d in rendered[case]:
        if d["kind"] == "Deployment":
            serving = [d["spec"]["template"]["spec"]["containers"][0]]
            followers = []
        elif d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]
            serving, followers = [t["leaderTemplate"]["spec"]["containers"][0]], [t["workerTemplate"]["spec"]["containers"][0]]
        else:
            continue
        for c in serving:
            port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
            assert port == values["server"]["port"] == int(_arg(_serve_args(c), "--port"))
            assert c["startupProbe"]["httpGet"]["path"] == "/ready"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["httpGet"]["path"] in routes
                assert c[probe]["httpGet"]["port"] == "http"
            budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
            assert budget >= int(_arg(_serve_args(c), "--startup-timeout")) == values["server"]["startupTimeoutSeconds"]
        for c in followers:  # ranks > 0 serve no HTTP: no probe may point at them
            assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(c)


@pytest.mark.parametrize("case", CASES)
def test_grace_period_covers_prestop_and_drain(case, rendered) -> None:
    for spec in pod_specs(rendered[case]):
        c = spec["containers"][0]
        sleep = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        drain = int(_arg(_serve_args(c), "--drain-timeout"))
        assert drain == CASES[case]["server"]["drainTimeoutSeconds"]
        assert spec["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain


@pytest.mark.parametrize("case", CASES)
def test_non_root_read_only_no_escalation(case, rendered) -> None:
    for spec in pod_specs(rendered[case]):
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            # what a read-only root leaves writable: /tmp (IPC dirs, HOME), /cache (probe, numba, triton caches)
            assert {"/tmp", "/cache", "/dev/shm"} <= set(mounts)
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["HOME"] == "/tmp" and env["STRATA_CACHE"].startswith("/cache/")
            assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
            model = mounts[CASES[case]["model"]["volume"]["mountPath"]]
            assert model["readOnly"] is True and volumes[model["name"]]["persistentVolumeClaim"]["readOnly"] is True


def test_multi_node_runs_torchrun_from_the_leaderworkerset_environment(rendered) -> None:
    docs = kinds(rendered["tp4-two-nodes"])
    lws = docs["LeaderWorkerSet"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for part in ("leaderTemplate", "workerTemplate"):
        c = lws["spec"]["leaderWorkerTemplate"][part]["spec"]["containers"][0]
        script = c["args"][0]
        for var in ("LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"):
            assert f"${{{var}}}" in script
        assert "--nproc-per-node 2" in script and script.startswith("exec torchrun") and script.endswith('"$@"')
        assert _arg(_serve_args(c), "--tensor-parallel-size") == "4"
    assert docs["Service"]["spec"]["selector"]["strata.dev/role"] == "leader"


def test_autoscaling_scales_on_a_metric_the_server_exports(rendered) -> None:
    from strata.server.metrics import Metrics

    exported = Metrics().render().decode()
    so = kinds(rendered["autoscaling-keda"])["ScaledObject"]
    trig = so["spec"]["triggers"][0]
    assert trig["type"] == "prometheus" and "strata_num_requests_waiting" in trig["metadata"]["query"]
    hpa = kinds(rendered["autoscaling-hpa"])["HorizontalPodAutoscaler"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "strata_num_requests_waiting"
    assert re.search(r"^strata_num_requests_waiting[ {]", exported, re.M)
    assert "replicas" not in kinds(rendered["autoscaling-keda"])["Deployment"]["spec"]  # the autoscaler owns it
    assert all(d["kind"] not in ("ScaledObject", "HorizontalPodAutoscaler") for d in rendered["gpu1"])  # off by default


def test_service_monitor_and_dashboard(rendered) -> None:
    from strata.hardware.startup_checks import GpuCheck
    from strata.server.metrics import Metrics

    docs = kinds(rendered["monitoring-and-key"])
    ep = docs["ServiceMonitor"]["spec"]["endpoints"][0]
    assert ep["path"] == "/metrics" and "/metrics" in _route_paths() and ep["port"] == "http"
    assert ep["authorization"]["credentials"] == {"name": "strata-key", "key": "api-key"}  # /metrics needs the key
    dash = json.loads(docs["ConfigMap"]["data"]["strata.json"])
    assert dash == json.loads((CHART / "dashboards" / "strata.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for dcgm in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_DRAM_ACTIVE",
                 "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        assert dcgm in exprs
    m = Metrics()
    m.gpu_checks([GpuCheck("tf32", "0", False, "fp32 matmuls in full fp32")])
    m.step_phase.labels("forward").inc()  # labelled series appear once the engine reports a phase
    exported = {line.split("{")[0].split(" ")[0] for line in m.render().decode().splitlines() if not line.startswith("#")}
    used = set(re.findall(r"\bstrata_[a-z_]+", exprs))
    for name in used:  # every Strata series the dashboard reads is one the server exports
        assert name in exported or f"{name}_bucket" in exported or name.removesuffix("_bucket") + "_bucket" in exported, name
    for want in ("strata_time_to_first_token_seconds_bucket", "strata_time_per_output_token_seconds_bucket",
                 "strata_num_requests_waiting", "strata_kv_cache_usage_ratio", "strata_request_stage_seconds_total"):
        assert want in used


@pytest.mark.parametrize(("over", "words"), [
    ({"engine": {"flashAttention": True}}, "flashAttention"),  # an unknown field is refused, not ignored
    ({"gpu": {"count": "1"}}, "gpu"),
    ({"engine": {"device": "cuda", "tensorParallelSize": 2}, "gpu": {"count": 1}}, "tensorParallelSize=2"),
    ({"engine": {"device": "cpu"}, "gpu": {"count": 1}}, "count"),
    ({"model": {"volume": {"type": "hostPath", "hostPath": "relative/dir", "mountPath": "/models"}}}, "hostPath"),
])
def test_bad_values_are_refused_naming_the_field(over, words) -> None:
    with pytest.raises(helm.HelmError) as e:
        render(over)
    assert words in str(e.value)


def test_the_validators_catch_a_wrong_field(rendered) -> None:
    """The checks above are not vacuous: a misspelt field fails each kind of validation."""
    import copy

    import jsonschema
    import kubernetes_validate

    dep = copy.deepcopy(kinds(rendered["gpu1"])["Deployment"])
    dep["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # "resources" misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(dep)
    lws = copy.deepcopy(kinds(rendered["tp4-two-nodes"])["LeaderWorkerSet"])
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(lws)
    so = copy.deepcopy(kinds(rendered["autoscaling-keda"])["ScaledObject"])
    so["spec"]["minReplicas"] = 1  # KEDA's field is minReplicaCount
    with pytest.raises(jsonschema.ValidationError):
        validate_object(so)


@pytest.mark.parametrize("case", ["default", "tp4-two-nodes", "monitoring-and-key"])
def test_helm_lint_finds_no_warning(case) -> None:
    report = helm.lint(str(CHART), CASES[case], strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
