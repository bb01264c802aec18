"""`strata deploy render`: the planner picks GPUs and tensor parallelism, and the values and the
rendered manifests carry the plan's numbers (Llama-2-7B fp16 on one A100-80GB; Llama-3-70B on
H100x4 -> TP=4; across nodes; a CPU pod)."""

from __future__ import annotations

import json

import pytest
import yaml

from strata.deploy.render import ChartOptions, build_values, chart_dir, render_manifests
from strata.deploy.sizing import DeployRequest, GiB, MiB, size_deployment
from strata.errors import ConfigError
from strata.planner.calibrate import StepOverhead
from strata.planner.plan import PlanRequest, build_plan
from tests.deploy.manifests import kinds, pod_specs, validate_object, validate_values


def _llama(hidden, inter, layers, heads, kv, vocab, max_pos, dtype):
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": vocab, "tie_word_embeddings": False, "max_position_embeddings": max_pos, "torch_dtype": dtype}


LLAMA2_7B = _llama(4096, 11008, 32, 32, 32, 32000, 4096, "float16")
LLAMA3_70B = _llama(8192, 28672, 80, 64, 8, 128256, 8192, "bfloat16")


def _model(tmp_path, name: str, cfg: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _container(docs: list[dict]) -> dict:
    return pod_specs(docs)[0]["containers"][0]


def _arg(c: dict, flag: str) -> str:
    args = c["args"] if c["command"] == ["strata"] else c["args"][2:]
    return args[args.index(flag) + 1]


def _render(s, **opts):
    chart = chart_dir(None)
    values = build_values(s, ChartOptions(**opts), chart)
    validate_values(values)
    docs = [d for text in render_manifests(chart, values, "strata", "default").values()
            for d in yaml.safe_load_all(text) if d]
    for d in docs:
        validate_object(d)
    return values, docs


def test_llama2_7b_fp16_on_one_a100_80gb(tmp_path) -> None:
    model = _model(tmp_path, "Llama-2-7b-hf", LLAMA2_7B)
    s = size_deployment(DeployRequest(model=model, hardware="A100-80G", concurrency=16))
    assert (s.tensor_parallel_size, s.gpus_per_pod, s.nodes_per_replica, s.dtype) == (1, 1, 1, "float16")
    # the plan's own memory for TP=1, independently: weights, activations, the rest of 90% of 80 GiB is KV
    plan = build_plan(PlanRequest(model=model, hardware="A100-80GBx1", batch=16))
    m = plan.memory
    assert m.weight_bytes == s.weight_bytes and abs(m.weight_bytes / 2 / 6.74e9 - 1) < 0.01
    kv = (int(80 * GiB * 0.9) - m.weight_bytes - m.activation_bytes) // MiB * MiB
    assert s.kv_cache_memory == kv
    # with that budget the planner's block count is the engine's (memory/planner.plan_memory)
    again = build_plan(PlanRequest(model=model, hardware="A100-80GB", batch=16, kv_cache_memory=kv)).memory
    assert s.kv_tokens == again.kv_tokens and s.max_sequences == again.max_sequences >= 16
    assert again.kv_per_token == 512 * 2**10  # the known answer (tests/analyze/test_plan.py)

    values, docs = _render(s)
    assert values["engine"] | {"extraArgs": []} == {
        "device": "cuda", "dtype": "float16", "tensorParallelSize": 1, "maxModelLen": 4096,
        "kvCacheMemory": f"{kv // MiB}MiB", "quantization": "", "threads": None, "extraArgs": []}
    c = _container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and "nvidia.com/gpu" not in c["resources"]["requests"]
    assert _arg(c, "--kv-cache-memory") == f"{kv // MiB}MiB" and _arg(c, "--tensor-parallel-size") == "1"
    assert _arg(c, "--dtype") == "float16" and _arg(c, "--drain-timeout") == str(s.drain_timeout)
    assert c["resources"]["limits"]["cpu"] == str(s.cpu) and c["resources"]["limits"]["memory"] == f"{s.memory // GiB}Gi"
    assert kinds(docs)["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == \
        s.pre_stop_seconds + s.drain_timeout + 10
    assert c["image"] == "strata:0.1.0-cuda" and _arg(c, "--model") == "/models/Llama-2-7b-hf"


def test_llama3_70b_on_h100x4_is_tp4_with_the_reasons(tmp_path) -> None:
    model = _model(tmp_path, "Meta-Llama-3-70B", LLAMA3_70B)
    s = size_deployment(DeployRequest(model=model + "/config.json", hardware="H100x4", max_model_len=8192))
    assert (s.tensor_parallel_size, s.gpus_per_pod, s.nodes_per_replica) == (4, 4, 1)
    assert s.reasons[0].startswith("TP=1") and "KV room for 0 sequences" in s.reasons[0]
    assert s.reasons[1].startswith("TP=2") and "16 wanted" in s.reasons[1]
    assert s.reasons[2].startswith("TP=4") and "chosen" in s.reasons[2]
    plan = build_plan(PlanRequest(model=model, hardware="H100x4", max_model_len=8192, batch=16))
    tp4 = next(o for o in plan.tp_options if o.tp == 4).memory
    assert s.weight_bytes == tp4.weight_bytes == pytest.approx(plan.memory.weight_bytes / 4, rel=1e-6)
    assert s.kv_cache_memory == (int(80 * GiB * 0.9) - tp4.weight_bytes - tp4.activation_bytes) // MiB * MiB
    values, docs = _render(s)
    c = _container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4" and _arg(c, "--tensor-parallel-size") == "4"
    assert _arg(c, "--dtype") == "bfloat16" and _arg(c, "--max-model-len") == "8192"
    assert values["shm"]["sizeLimit"] == "4Gi"  # TP ranks on one pod share /dev/shm
    # the startup budget covers reading 4 shards' weights
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= s.startup_seconds >= 300


def test_tensor_parallel_across_two_nodes_is_a_leaderworkerset(tmp_path) -> None:
    model = _model(tmp_path, "Meta-Llama-3-70B", LLAMA3_70B)
    s = size_deployment(DeployRequest(model=model, hardware="H100x2", max_model_len=8192, max_nodes=2))
    assert (s.tensor_parallel_size, s.gpus_per_pod, s.nodes_per_replica) == (4, 2, 2)
    values, docs = _render(s)
    assert values["multiNode"] == {"enabled": True, "size": 2, "masterPort": 29500}
    lws = kinds(docs)["LeaderWorkerSet"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    for spec in pod_specs(docs):
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    with pytest.raises(ConfigError, match="LeaderWorkerSet"):
        build_values(s, ChartOptions(autoscaling="keda"), chart_dir(None))


def test_does_not_fit_says_why_and_the_fix(tmp_path) -> None:
    model = _model(tmp_path, "Meta-Llama-3-70B", LLAMA3_70B)
    with pytest.raises(ConfigError) as e:
        size_deployment(DeployRequest(model=model, hardware="L4x2", max_model_len=8192))
    msg = str(e.value)
    assert "does not fit on L4x2" in msg and "TP=2" in msg and "--quantization" in msg


def test_cpu_pod_like_this_machine(cpu_profile) -> None:
    s = size_deployment(DeployRequest(model="tiny", hardware="this", dtype="float32", concurrency=4, cpus=3),
                        profile=cpu_profile, overhead=StepOverhead.zero())
    assert (s.device, s.gpus_per_pod, s.tensor_parallel_size, s.threads, s.cpu) == ("cpu", 0, 1, 3, 3)
    assert s.max_sequences >= 4 and s.kv_cache_memory % MiB == 0
    assert s.memory >= s.weight_bytes + s.activation_bytes + s.kv_cache_memory + s.shm
    values, docs = _render(s)
    c = _container(docs)
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and _arg(c, "--threads") == "3" == c["resources"]["limits"]["cpu"]
    assert _arg(c, "--device") == "cpu" and c["image"] == "strata:0.1.0-cpu"


def test_cli_writes_values_and_manifests(tmp_path, capsys) -> None:
    from strata.cli import main

    model = _model(tmp_path, "Llama-2-7b-hf", LLAMA2_7B)
    out = tmp_path / "out"
    code = main(["deploy", "render", "--model", model, "--hardware", "A100-80G", "--explain", "-o", str(out),
                 "--image", "ghcr.io/me/strata:1-cuda", "--model-volume", "hostPath:/data/llama2",
                 "--service-monitor", "--autoscaling", "keda"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "1 x A100-80GB per replica (TP=1)" in printed.out and "  - TP=1:" in printed.out
    values = yaml.safe_load((out / "values.yaml").read_text())
    validate_values(values)
    assert values["image"] == {"repository": "ghcr.io/me/strata", "tag": "1-cuda", "pullPolicy": "IfNotPresent"}
    assert values["model"]["volume"]["type"] == "hostPath"
    names = sorted(p.name for p in (out / "manifests").iterdir())
    assert names == ["autoscaling.yaml", "deployment.yaml", "poddisruptionbudget.yaml", "service.yaml",
                     "servicemonitor.yaml"]
    for p in (out / "manifests").iterdir():
        for d in yaml.safe_load_all(p.read_text()):
            validate_object(d)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tensor_parallel_size"] == 1 and plan["reasons"]


@pytest.mark.parametrize(("argv", "words"), [
    (["--hardware", "B300"], "unknown accelerator 'B300'"),
    (["--hardware", "A100", "--model-volume", "nfs:x"], "--model-volume 'nfs:x'"),
    (["--hardware", "A100", "--image", "strata"], "--image 'strata'"),
    (["--hardware", "A100", "--concurrency", "0"], "--concurrency: must be >= 1"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, argv, words) -> None:
    from strata.cli import main

    model = _model(tmp_path, "Llama-2-7b-hf", LLAMA2_7B)
    assert main(["deploy", "render", "--model", model, "-o", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err
