"""`strata bench comm --world-size 2` end to end (a short size range): the tables (all-to-all's
too), the JSON fields, the fitted model stored in the (seeded, temporary) hardware profile,
nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from comm_ranks import bounded, shm_files

from strata.bench.comm import parse_sizes
from strata.errors import ConfigError


def test_parse_sizes() -> None:
    assert parse_sizes("8B:64B") == [8, 16, 32, 64]
    assert parse_sizes("8B:1KiB", 4) == [8, 32, 128, 512]
    assert parse_sizes("64KiB") == [65536]
    assert parse_sizes("1MiB,4KiB") == [4096, 2**20]
    with pytest.raises(ConfigError):
        parse_sizes("1MiB:8B")
    with pytest.raises(ConfigError):
        parse_sizes("8B:1KiB", 1)


def _py(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()


def test_bench_comm_end_to_end(tmp_path) -> None:
    env = {**os.environ, "STRATA_CACHE": str(tmp_path / "cache")}
    # seed the cache with a synthetic profile so the bench does not have to measure one
    path = _py("from strata.hardware.probe import profile_path; print(profile_path('cpu'))", env)
    seeded = json.loads(_py(
        "import json, torch; from strata.hardware.probe import HardwareProfile, _identity; "
        "ident = _identity(torch.device('cpu')); ident.pop('schema'); "
        "p = HardwareProfile(**ident, mem_bandwidth_gbs=30.0, linear_gbs={'float32': 20.0}, "
        "matmul_gflops={'float32': 50.0}); d = p.to_json(); d.pop('comm_model'); print(json.dumps(d))", env))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(seeded, f)
    out = tmp_path / "comm.json"
    before = shm_files()
    with bounded(300):
        r = subprocess.run([sys.executable, "-m", "strata", "bench", "comm", "--world-size", "2",
                            "--sizes", "8B:64KiB", "--factor", "8", "--budget-s", "0.03", "--passes", "1",
                            "--compress", "bfloat16", "--timeout", "20", "--run-timeout", "200",
                            "--json", str(out)], env=env, capture_output=True, text=True, timeout=260)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout
    for what in ("all_reduce via shm, 2 ranks", "all_reduce via gloo, 2 ranks", "all_gather via gloo",
                 "broadcast via gloo", "all_to_all via shm, 2 ranks", "all_to_all via gloo, 2 ranks",
                 "SHM vs gloo all-to-all (fitted): 4.0 KiB per rank", "Fitted alpha-beta model", "busbw GB/s", "numeric error",
                 "stored the fit in the hardware profile"):
        assert what in text, (what, text[-3000:])
    d = json.loads(out.read_text())
    assert d["world_size"] == 2 and d["shm_state"] == "on" and d["profile"] == path
    sizes = [8, 64, 512, 4096, 32768]
    for coll, tr in (("all_reduce", "shm"), ("all_reduce", "gloo"), ("all_gather", "gloo"), ("broadcast", "gloo"),
                     ("all_to_all", "shm"), ("all_to_all", "gloo")):
        pts = [p for p in d["points"] if (p["collective"], p["transport"]) == (coll, tr)]
        assert [p["bytes"] for p in pts] == sizes, (coll, tr)
        for p in pts:
            assert p["p10_s"] <= p["median_s"] <= p["p90_s"] and p["reps"] >= 3 and len(p["pass_medians_s"]) == 1
            assert p["algbw_gbs"] > 0 and p["model_s"] > 0 and math_ok(p["model_err"])
            factor = {"all_reduce": 1.0, "all_gather": 0.5, "broadcast": 1.0, "all_to_all": 0.5}[coll]  # 2(n-1)/n, (n-1)/n
            assert p["busbw_gbs"] == pytest.approx(p["algbw_gbs"] * factor)
    assert any(p["transport"] == "shm+bfloat16" for p in d["points"])
    fits = {(f["collective"], f["transport"]): f for f in d["fits"]}
    assert fits[("all_reduce", "shm")]["segments"][0]["alpha_s"] > 0
    assert fits[("all_reduce", "gloo")]["segments"][-1]["beta_bps"] > 0
    assert fits[("all_reduce", "gloo")]["formula"] == "2(n-1)*a + 2(n-1)/n*S/b"
    assert fits[("all_to_all", "shm")]["formula"] == "a + 2*S/b"
    assert fits[("all_to_all", "gloo")]["formula"] == "(n-1)*a + (n-1)/n*S/b"
    errs = {(e["transport"], e["comm_dtype"], e["bytes"]) for e in d["errors"]}
    assert ("shm", "bfloat16", 65536) in errs and ("gloo", "float32", 65536) in errs
    stored = json.loads(open(path).read())
    assert stored["mem_bandwidth_gbs"] == 30.0  # the rest of the profile untouched
    assert {f["transport"] for f in stored["comm_model"]["fits"]} >= {"shm", "gloo"}
    assert shm_files() - before == set()
    loaded = _py("from strata.hardware.probe import cached_comm_model; "
                 "m = cached_comm_model('cpu'); print(m.best('all_reduce', 65536, 2, ['shm', 'gloo'])[0], "
                 "m.all_to_all_seconds(65536, 2) > 0)", env)
    assert loaded in ("shm True", "gloo True")


def math_ok(x: float) -> bool:
    return x == x and abs(x) < 100


def test_a_point_pools_the_repetitions_of_its_passes() -> None:
    from strata.bench.comm import pass_spread
    from strata.comm.bench_worker import pooled

    head = {"collective": "all_reduce", "transport": "gloo", "bytes": 8}
    p = pooled([dict(head, times=[3.0, 1.0, 2.0]), dict(head, times=[10.0, 11.0])])
    assert p["median_s"] == 3.0 and p["reps"] == 5 and p["min_s"] == 1.0 and p["max_s"] == 11.0
    assert p["pass_medians_s"] == [2.0, 10.5] and "times" not in p and p["bytes"] == 8
    assert pass_spread(p) == pytest.approx((10.5 - 2.0) / 3.0)
