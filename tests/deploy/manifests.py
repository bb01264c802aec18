"""Render the chart with Helm's own engine and validate what comes out.

Kubernetes kinds are validated by kubernetes-validate (the API's JSON schemas, strict: an unknown
field fails). The three custom resources (LeaderWorkerSet, ServiceMonitor, ScaledObject) have no
schema there: their fields are checked against CRD_SCHEMAS below (written from the upstream
CRDs' field lists, only the fields the chart sets, additionalProperties false), and the pod
templates inside a LeaderWorkerSet are validated as core PodTemplates by kubernetes-validate.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "strata"
KUBE_VERSION = "1.30.0"

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (Helm's Go engine as a library) is not installed: `pip install -e .[dev]` "
    "installs it on x86_64 Linux, macOS and Windows; without it the chart cannot be rendered offline")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (dev extra)")

_str_map = {"type": "object", "additionalProperties": {"type": "string"}}
_meta = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "labels": _str_map,
                                                                  "annotations": _str_map}}
_int_or_str = {"type": ["integer", "string"]}
CRD_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): {
        "type": "object", "required": ["spec"],
        "properties": {"metadata": _meta, "spec": {
            "type": "object", "additionalProperties": False, "required": ["leaderWorkerTemplate", "startupPolicy"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object", "additionalProperties": False, "required": ["type"], "properties": {
                    "type": {"enum": ["RollingUpdate"]},
                    "rollingUpdateConfiguration": {"type": "object", "additionalProperties": False, "properties": {
                        "maxUnavailable": _int_or_str, "maxSurge": _int_or_str, "partition": {"type": "integer"}}}}},
                "leaderWorkerTemplate": {
                    "type": "object", "additionalProperties": False, "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                                   "None"]},
                        "leaderTemplate": {"type": "object"}, "workerTemplate": {"type": "object"}}}}}}},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object", "required": ["spec"],
        "properties": {"metadata": _meta, "spec": {
            "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": _str_map}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                     "(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
                        "authorization": {"type": "object", "additionalProperties": False, "properties": {
                            "type": {"type": "string"},
                            "credentials": {"type": "object", "additionalProperties": False, "required": ["key"],
                                            "properties": {"name": {"type": "string"}, "key": {"type": "string"}}}}}}}}}}}},
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object", "required": ["spec"],
        "properties": {"metadata": _meta, "spec": {
            "type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
                    "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"}}},
                "minReplicaCount": {"type": "integer"}, "maxReplicaCount": {"type": "integer"},
                "cooldownPeriod": {"type": "integer"}, "pollingInterval": {"type": "integer"},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["type", "metadata"],
                    "properties": {"type": {"type": "string"}, "metadata": _str_map}}}}}}},
}


def chart_defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def merged(over: dict) -> dict:
    def merge(a, b):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out
    return merge(chart_defaults(), over)


def validate_values(values: dict) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)


def render(values: dict | None = None, release: str = "strata", namespace: str = "default") -> list[dict]:
    """The chart rendered by Helm with `values` over its defaults: the Kubernetes objects."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=release, namespace=namespace, is_install=True)
    docs = []
    for name, text in sorted(out.items()):
        if name.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def validate_object(obj: dict) -> str:
    """Validate one object; returns what it was validated against."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.Draft7Validator(CRD_SCHEMAS[key]).validate(obj)
        if obj["kind"] == "LeaderWorkerSet":
            lwt = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": f"{obj['metadata']['name']}-{part}"},
                                              "template": lwt[part]}, KUBE_VERSION, strict=True)
            return "CRD fields + PodTemplate schema x2"
        return "CRD fields"
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    return f"Kubernetes {KUBE_VERSION} schema (strict)"


def kinds(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def pod_specs(docs: list[dict]) -> list[dict]:
    """Every pod spec in the rendered objects (Deployment, or the LeaderWorkerSet's two templates)."""
    out = []
    for d in docs:
        if d["kind"] == "Deployment":
            out.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]
            out += [t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]]
    return out
