"""`strata bench throughput|latency` end to end on the tiny random model, with the HF peer."""

from __future__ import annotations

import json
import math

import pytest

from strata.cli import main

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))


def _positive(d: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        assert isinstance(d[k], int | float) and math.isfinite(d[k]) and d[k] > 0, (k, d[k])


def test_throughput_vs_hf_writes_json(tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main([
        "bench", "throughput", "--random-model", "tiny", "--dtype", "float32", "--threads", "1",
        "--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:8", "--seed", "3",
        "--compare", "hf", "--hf-batch-size", "2", "--json", str(out),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "strata/hf" in printed
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 4 and data["threads"] == 1
    assert 4 * 8 <= data["prompt_tokens"] <= 4 * 16 and 4 * 4 <= data["output_tokens"] <= 4 * 8
    figures = ("requests", "elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
    _positive(data["strata"], figures)
    _positive(data["hf"], figures)
    assert data["strata"]["requests"] == data["hf"]["requests"] == 4
    _positive(data["ratio"], ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"))


def test_latency_vs_hf_writes_json(tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main([
        "bench", "latency", "--random-model", "tiny", "--dtype", "float32", "--threads", "1",
        "--batch", "2", "--input-len", "8", "--output-len", "4", "--warmup", "1",
        "--compare", "hf", "--json", str(out),
    ])
    assert main(["bench", "latency", "--random-model", "tiny", "--repeats", "0"]) == 2
    assert rc == 0
    printed = capsys.readouterr().out
    assert "memory bandwidth" in printed and "MBU" in printed
    data = json.loads(out.read_text())
    _positive(data, ("mem_bandwidth_gbs", "weight_bytes", "kv_bytes_per_token", "params"))
    figures = ("prefill_s", "prefill_tokens_per_s", "prefill_gflops", "decode_s", "ms_per_step",
               "decode_tokens_per_s_per_seq", "decode_tokens_per_s", "achieved_gbs", "mbu")
    for engine in ("strata", "hf"):
        _positive(data[engine], figures)
        assert data[engine]["decode_steps"] == 3
        assert data[engine]["decode_tokens_per_s"] == pytest.approx(2 * data[engine]["decode_tokens_per_s_per_seq"])
        runs = data[engine]["runs"]  # --repeats defaults to 3: the figures are the medians
        assert len(runs) == data["repeats"] == 3
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            assert data[engine][key] == pytest.approx(sorted(r[key] for r in runs)[1])
            assert data[engine]["spread"][key] >= 0
    _positive(data["ratio"], ("prefill_tokens_per_s", "decode_tokens_per_s", "mbu"))
    assert isinstance(data["unstable"], list)


def test_competing_load_children_are_reaped():
    import os

    from strata.bench.common import CompetingLoad

    with CompetingLoad(2) as load:
        pids = [p.pid for p in load.procs]
        assert len(pids) == 2 and all(p.poll() is None for p in load.procs)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError), CompetingLoad(1) as load:  # reaped on an error too
        pid = load.procs[0].pid
        raise RuntimeError("inside")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_stability_notes_name_what_moved():
    from strata.bench.common import median_of_runs, spread, stability_notes

    assert spread([10.0, 12.0, 11.0]) == pytest.approx(2 / 11)
    m = median_of_runs([{"a": 1.0, "b": 4}, {"a": 3.0, "b": 5}, {"a": 2.0, "b": 9}], ("a",))
    assert m["a"] == 2.0 and m["b"] == 5 and m["spread"]["a"] == pytest.approx(1.0) and len(m["runs"]) == 3
    quiet = stability_notes(30.0, 29.0, 1.0, 1.0, 1, {"strata": {"decode": 0.05}})
    assert quiet == []
    notes = stability_notes(30.0, 15.0, 1.0, 40.0, 1, {"strata": {"decode": 0.5}, "hf": {"decode": 0.01}})
    text = " | ".join(notes)
    assert "bandwidth moved" in text and "30.0 -> 15.0" in text
    assert "other processes" in text and "strata: repeats disagree by decode 50%" in text and "hf:" not in text


def test_bad_flags_are_reported(tmp_path, capsys):
    assert main(["bench", "throughput", "--random-model", "tiny", "--input-len", "9:3"]) == 2
    assert "--input-len" in capsys.readouterr().err
    assert main(["bench", "latency", "--random-model", "tiny", "--output-len", "1"]) == 2
    assert "--output-len" in capsys.readouterr().err
    assert main(["bench", "latency", "--random-model", "tiny", "--model", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err


def test_sampled_workloads_run_and_say_so(tmp_path, capsys):
    out = tmp_path / "lat.json"
    common = ["--random-model", "tiny", "--dtype", "float32", "--threads", "1", "--temperature", "0.8",
              "--top-p", "0.9", "--top-k", "20"]
    assert main(["bench", "latency", *common, "--input-len", "8", "--output-len", "4", "--warmup", "0",
                 "--repeats", "1", "--json", str(out)]) == 0
    assert "sampled (temperature 0.8, top_p 0.9, top_k 20)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert (data["temperature"], data["top_p"], data["top_k"]) == (0.8, 0.9, 20)
    assert data["strata"]["decode_steps"] == 3  # ignore_eos: every request runs to its length
    assert main(["bench", "throughput", *common, "--num-prompts", "3", "--input-len", "8", "--output-len", "4"]) == 0
    assert "sampled (temperature 0.8" in capsys.readouterr().out
    # transformers' loop is greedy: a sampled run beside it would time other work; bad values named
    assert main(["bench", "latency", *common, "--compare", "hf"]) == 2
    assert "--compare hf runs transformers greedily" in capsys.readouterr().err
    assert main(["bench", "throughput", "--random-model", "tiny", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_latency_with_chunked_prefill_counts_only_steps_that_decode_the_whole_batch(tmp_path):
    """Prompts over the step budget prefill in chunks: the early sequences decode (and finish)
    sooner, so only the steps in which every sequence decodes count as batch decode steps."""
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--random-model", "tiny", "--dtype", "float32", "--threads", "1",
            "--batch", "4", "--input-len", "16", "--max-num-batched-tokens", "32", "--max-model-len", "32",
            "--warmup", "0", "--repeats", "1"]
    assert main([*args, "--output-len", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())["strata"]
    assert 1 <= data["decode_steps"] < 7  # two prompts a step: the first two finish a step or more early
    assert data["decode_tokens_per_s"] == pytest.approx(4 * data["decode_steps"] / data["decode_s"])
    assert main([*args, "--output-len", "2"]) == 2  # no step decodes all four: a clear error, not a figure


def test_throughput_and_lora_benches_with_adapters(tmp_path, capsys):
    """`bench throughput --lora-adapters N` serves the workload over N random adapters; `bench lora`
    runs every adapter count and both batch-1 cases each round (figures not asserted: speed)."""
    common = ["--random-model", "tiny", "--dtype", "float32", "--threads", "1", "--num-prompts", "3",
              "--input-len", "8", "--output-len", "4"]
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", *common, "--lora-adapters", "2", "--max-lora-rank", "8",
                 "--json", str(out)]) == 0
    assert "2 LoRA adapters rank 8 round robin" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["lora_adapters"] == 2 and data["strata"]["requests"] == 3
    assert main(["bench", "throughput", *common, "--lora-adapters", "1", "--compare", "hf"]) == 2
    assert "base model only" in capsys.readouterr().err
    lora = tmp_path / "lora.json"
    assert main(["bench", "lora", *common, "--adapters", "0,2", "--rank", "8", "--rounds", "1",
                 "--lora-dtype", "bfloat16", "--json", str(lora)]) == 0
    data = json.loads(lora.read_text())
    assert data["lora_dtype"] == "bfloat16" and data["cpu"]
    assert {k: len(v) for k, v in data["rounds"].items()} == {
        "throughput 0": 1, "throughput 2": 1, "decode base": 1, "decode 1 adapter": 1}
    assert all(v[0] > 0 for v in data["rounds"].values())
