"""`strata bench train` on the tiny shape (1 thread, 2 timed steps), its worker processes, and the
summary arithmetic. Nothing asserts on speed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import psutil
import pytest

from strata.bench import train as bench_train
from strata.cli import main
from strata.errors import ConfigError

TINY = ["--model", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "2", "--warmup", "1",
        "--repeats", "1", "--threads", "1"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A private cache, and a fixed peak GEMM rate: MFU without probing the machine (seconds)."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_train, "peak_gflops", lambda dtypes, device: {d: 100.0 for d in dtypes})


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_strata_and_hf_rows_with_ratio(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "train.json"
    before = _children()
    assert main(["bench", "train", *TINY, "--precision", "float32", "--json", str(out)]) == 0
    assert _children() <= before  # every worker reaped
    printed = capsys.readouterr().out
    assert "strata/hf" in printed and "tok/s" in printed and "cpu:" in printed
    data = json.loads(out.read_text())
    assert data["threads"] == 1 and data["seq_len"] == 32 and data["batch"] == 2
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"strata", "hf"}
    for row in rows.values():
        assert row["precision"] == "float32" and row["activation_checkpointing"] == "none"
        assert row["timed_steps"] == 2 and row["tokens_per_step"] == 64
        for key in ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "step_s", "mfu",
                    "peak_memory_bytes"):
            assert _positive(row[key]), (row["engine"], key, row[key])
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert len(row["runs"]) == 1 and len(row["runs"][0]["losses"]) == 3
    (ratio,) = data["ratios"]
    assert _positive(ratio["tokens_per_s"]) and _positive(ratio["peak_memory_bytes"])


def test_activation_checkpointing_pair_is_summarised(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert main(["bench", "train", *TINY, "--precision", "float32", "--activation-checkpointing", "none,full",
                 "--peer", "none", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "strata, float32: activation checkpointing full vs none: peak memory" in printed
    data = json.loads(out.read_text())
    modes = {r["activation_checkpointing"]: r for r in data["rows"]}
    assert set(modes) == {"none", "full"} and all(r["engine"] == "strata" for r in data["rows"])
    assert modes["full"]["checkpointed_layers"] == 2 and modes["none"]["checkpointed_layers"] == 0
    assert [s["kind"] for s in data["summaries"]] == ["activation_checkpointing"]


def test_bad_model_is_one_line_error(capsys):
    assert main(["bench", "train", "--model", "no-such-model", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "--model no-such-model" in err and "not a named size" in err and "Traceback" not in err


def test_failing_worker_is_reaped_with_its_error():
    before = _children()
    spec = bench_train.RunSpec("strata", "float32", "none")
    argv = ["--json", "--engine", "strata", "--model", "no-such-model", "--threads", "1"]
    with pytest.raises(bench_train.WorkerFailed) as e:
        bench_train.run_worker(argv, spec.label, timeout_s=120, threads=1)
    assert "--model no-such-model" in str(e.value) and "Traceback" not in str(e.value)
    assert _children() <= before


def test_worker_past_its_timeout_is_killed_and_reaped():
    before = _children()
    with pytest.raises(bench_train.WorkerFailed, match="ran past --timeout"):
        bench_train.run_worker(["--json", "--model", "tiny"], "strata (slow)", timeout_s=0.05, threads=1)
    assert _children() <= before


def test_worker_cli_bad_model_exits_nonzero_without_traceback():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "strata.bench.train_worker", "--json", "--model", "nope"],
                          capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert "not a named size" in json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert "Traceback" not in done.stderr


def test_parse_choices_accepts_repeats_and_commas():
    got = bench_train.parse_choices(["float32,bfloat16", "float32"], ("float32", "bfloat16"), "--precision", "auto")
    assert got == ["float32", "bfloat16"]
    assert bench_train.parse_choices(None, ("none", "full"), "--activation-checkpointing", "none") == ["none"]
    with pytest.raises(ConfigError, match="--precision fp8: choose from"):
        bench_train.parse_choices(["fp8"], ("float32",), "--precision", "float32")


def test_plan_runs_alternates_and_skips_modes_without_a_peer():
    specs = bench_train.plan_runs(["float32"], ["none", "selective"], "hf")
    assert [(s.engine, s.activation_checkpointing) for s in specs] == [
        ("strata", "none"), ("hf", "none"), ("strata", "selective")]


def _row(precision: str, mode: str, step_s: float, peak: int, train: int) -> dict:
    return {"engine": "strata", "precision": precision, "activation_checkpointing": mode, "step_s": step_s,
            "peak_memory_bytes": peak, "train_memory_bytes": train}


def test_summaries_compare_checkpointing_and_precision():
    rows = [_row("float32", "none", 1.0, 1000, 800), _row("float32", "full", 1.25, 600, 400),
            _row("bfloat16", "none", 0.5, 900, 700)]
    texts = [s["text"] for s in bench_train.summaries(rows)]
    assert texts == [
        "strata, float32: activation checkpointing full vs none: peak memory -40.0% "
        "(memory added by training -50.0%), step time +25.0%",
        "strata, activation checkpointing none: bf16 vs fp32 step time: 0.50x",
    ]
