"""The alpha-beta model: formulas, the least-squares fit on synthetic points, JSON, the choice of
the cheapest transport, and the comm model's place in the hardware profile."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from strata.comm.alpha_beta import (
    FORMULAS,
    CommModel,
    Fit,
    Segment,
    bus_bandwidth,
    fit,
    model_seconds,
)

SIZES = [8 * 4**k for k in range(12)]  # 8 B .. 32 MiB


@pytest.mark.parametrize("algorithm", sorted(FORMULAS))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_known_alpha_beta(algorithm: str, n: int) -> None:
    alpha, beta = 7e-6, 12e9
    times = [model_seconds(algorithm, s, n, alpha, beta) for s in SIZES]
    f = fit("all_reduce", "x", n, SIZES, times, algorithm)
    assert f.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert f.beta_bps == pytest.approx(beta, rel=1e-6)
    assert max(abs(e) for e in f.rel_errors()) < 1e-6


def test_fit_with_noise_and_bounds() -> None:
    rng = random.Random(0)
    alpha, beta = 150e-6, 2.5e9
    times = [model_seconds("ring", s, 2, alpha, beta) * (1 + rng.uniform(-0.05, 0.05)) for s in SIZES]
    f = fit("all_reduce", "gloo", 2, SIZES, times)
    assert f.algorithm == "ring"
    assert f.alpha_s == pytest.approx(alpha, rel=0.1) and f.beta_bps == pytest.approx(beta, rel=0.1)
    assert max(abs(e) for e in f.rel_errors()) < 0.12
    # pure bandwidth: alpha stays >= 0; pure latency: beta stays finite and positive
    bw = fit("all_reduce", "shm", 2, SIZES, [s / 1e10 for s in SIZES])
    assert bw.alpha_s == pytest.approx(0.0, abs=1e-12) and bw.beta_bps == pytest.approx(1e10 * 4, rel=1e-6)
    flat = fit("broadcast", "gloo", 2, SIZES[:3], [1e-4, 1e-4 * 0.98, 1e-4 * 0.97])
    assert flat.alpha_s > 0 and flat.beta_bps > 0 and all(abs(e) < 0.05 for e in flat.rel_errors())
    with pytest.raises(ValueError):
        fit("all_reduce", "shm", 2, [8], [])


def test_fit_finds_size_regimes() -> None:
    """A transport whose cost changes regime with the size (a protocol switch at 64 KiB, DRAM
    bandwidth past 8 MiB) gets one segment per regime, with each regime's alpha and beta."""
    sizes = [8 * 2**k for k in range(26)]  # 8 B .. 256 MiB
    regimes = [(0, 300e-6, 5e9), (64 * 1024, 500e-6, 1.5e9), (8 * 2**20, 0.0, 0.8e9)]

    def truth(s: int) -> float:
        _, a, b = [r for r in regimes if s >= r[0]][-1]
        return model_seconds("ring", s, 2, a, b)

    rng = random.Random(1)
    times = [truth(s) * (1 + rng.uniform(-0.03, 0.03)) for s in sizes]
    f = fit("all_reduce", "gloo", 2, sizes, times)
    assert len(f.segments) == 3
    assert max(abs(e) for e in f.rel_errors()) < 0.08
    assert 32 * 1024 < f.segments[1].from_bytes <= 64 * 1024 and 4 * 2**20 < f.segments[2].from_bytes <= 8 * 2**20
    assert f.segments[0].alpha_s == pytest.approx(300e-6, rel=0.05)
    assert f.segments[2].beta_bps == pytest.approx(0.8e9, rel=0.05)
    assert f.alpha_s == f.segments[0].alpha_s and f.beta_bps == f.segments[2].beta_bps
    assert f.predict(2**31) == pytest.approx(model_seconds("ring", 2**31, 2, f.segments[2].alpha_s, 0.8e9 * 1.0),
                                             rel=0.05)  # beyond the range: the last regime
    # one noisy line stays one line (the information criterion does not split noise)
    one = [model_seconds("ring", s, 2, 300e-6, 2e9) * (1 + rng.uniform(-0.1, 0.1)) for s in sizes]
    assert len(fit("all_reduce", "gloo", 2, sizes, one).segments) == 1
    # few points: one line; max_segments=1 forces one
    assert len(fit("all_reduce", "gloo", 2, sizes[:6], times[:6]).segments) == 1
    assert len(fit("all_reduce", "gloo", 2, sizes, times, max_segments=1).segments) == 1


def test_version_1_model_still_loads() -> None:
    old = {"version": 1, "fits": [{"collective": "all_reduce", "transport": "gloo", "algorithm": "ring",
                                  "world_size": 2, "alpha_s": 1e-4, "beta_bps": 1e9}]}
    m = CommModel.from_json(old)
    f = m.get("all_reduce", "gloo", 2)
    assert f.segments == (Segment(0.0, 1e-4, 1e9),)
    assert f.predict(1e6) == pytest.approx(model_seconds("ring", 1e6, 2, 1e-4, 1e9))
    bad = {"version": 2, "fits": [dict(old["fits"][0], segments=[
        {"from_bytes": 10, "alpha_s": 1e-4, "beta_bps": 1e9}, {"from_bytes": 5, "alpha_s": 1e-4, "beta_bps": 1e9}])]}
    with pytest.raises(ValueError, match="ascending"):
        CommModel.from_json(bad)


def test_formulas_and_bus_bandwidth() -> None:
    a, b, s = 5e-6, 100e9, 1e6
    assert model_seconds("ring", s, 8, a, b) == pytest.approx(2 * 7 * a + 2 * 7 / 8 * s / b)
    assert model_seconds("tree", s, 8, a, b) == pytest.approx(3 * a + 3 * s / b)
    assert model_seconds("shm", s, 4, a, b) == pytest.approx(a + 6 * s / b)
    assert model_seconds("ring_gather", s, 4, a, b) == pytest.approx(3 * a + 0.75 * s / b)
    assert model_seconds("tree_bcast", s, 5, a, b) == pytest.approx(3 * a + s / b)
    assert model_seconds("ring", s, 1, a, b) == 0.0
    alg, bus = bus_bandwidth("all_reduce", 1e6, 1e-3, 4)
    assert alg == pytest.approx(1e9) and bus == pytest.approx(1e9 * 2 * 3 / 4)
    assert bus_bandwidth("all_gather", 1e6, 1e-3, 4)[1] == pytest.approx(0.75e9)
    assert bus_bandwidth("broadcast", 1e6, 1e-3, 4)[1] == pytest.approx(1e9)
    assert model_seconds("pairwise", s, 4, a, b) == pytest.approx(3 * a + 0.75 * s / b)
    assert model_seconds("shm_a2a", s, 4, a, b) == pytest.approx(a + 2 * s / b)
    assert bus_bandwidth("all_to_all", 1e6, 1e-3, 4)[1] == pytest.approx(0.75e9)


def test_all_to_all_fit_round_trip() -> None:
    """Noisy all-to-all points over SHM and gloo -> fits -> JSON -> the planner's question, the
    seconds of an all-to-all of S bytes per rank, within the noise of the truth."""
    rng = random.Random(2)
    truth = {"shm": ("shm_a2a", 8e-6, 6e9), "gloo": ("pairwise", 140e-6, 1.5e9)}
    fits = []
    for tr, (alg, a, b) in truth.items():
        times = [model_seconds(alg, s, 2, a, b) * (1 + rng.uniform(-0.03, 0.03)) for s in SIZES]
        f = fit("all_to_all", tr, 2, SIZES, times)
        assert f.algorithm == alg and max(abs(e) for e in f.rel_errors()) < 0.07
        fits.append(f)
    m = CommModel.from_json(json.loads(json.dumps(CommModel(tuple(fits)).to_json())))
    assert m == CommModel(tuple(fits))
    for s in (4096, 65536, 2**20):
        want = min(model_seconds(alg, s, 2, a, b) for alg, a, b in truth.values())
        assert m.all_to_all_seconds(s, 2) == pytest.approx(want, rel=0.1)
        gloo = model_seconds("pairwise", s, 2, 140e-6, 1.5e9)
        assert m.all_to_all_seconds(s, 2, ["gloo"]) == pytest.approx(gloo, rel=0.1)
    # n = 4 from the n = 2 fits: each formula's scaling
    g = m.get("all_to_all", "gloo", 4)
    assert m.all_to_all_seconds(2**20, 4, ["gloo"]) == pytest.approx(
        model_seconds("pairwise", 2**20, 4, g.segment(2**20).alpha_s, g.segment(2**20).beta_bps))
    assert m.all_to_all_seconds(4096, 2, ["nccl"]) is None and CommModel().all_to_all_seconds(4096, 2) is None
    assert m.best("all_reduce", 4096, 2) is None  # all-to-all fits price nothing else


def _model() -> CommModel:
    shm = fit("all_reduce", "shm", 2, SIZES, [model_seconds("shm", s, 2, 9e-6, 20e9) for s in SIZES])
    gloo = fit("all_reduce", "gloo", 2, SIZES, [model_seconds("ring", s, 2, 110e-6, 2.5e9 * 1000) for s in SIZES])
    return CommModel((shm, gloo), host="h", measured_at="2026-01-01")


def test_best_transport_and_crossover() -> None:
    from strata.bench.comm import crossover

    m = _model()
    assert m.best("all_reduce", 64 * 1024, 2)[0] == "shm"
    assert m.best("all_reduce", 2**30, 2)[0] == "gloo"  # a (fictitious) very fast gloo wins big messages
    x = crossover(m, 2)
    shm, gloo = m.get("all_reduce", "shm", 2), m.get("all_reduce", "gloo", 2)
    assert shm.predict(x * 0.95) < gloo.predict(x * 0.95) and shm.predict(x * 1.05) > gloo.predict(x * 1.05)
    assert m.best("all_reduce", 64, 2, ["gloo"])[0] == "gloo"
    assert m.best("broadcast", 64, 2) is None and m.predict("broadcast", "gloo", 64, 2) is None
    # another n: the nearest fit, scaled by the formula
    assert m.predict("all_reduce", "gloo", 1e6, 4) == pytest.approx(model_seconds("ring", 1e6, 4, gloo.alpha_s, gloo.beta_bps))


def test_json_round_trip_and_merge() -> None:
    m = _model()
    back = CommModel.from_json(json.loads(json.dumps(m.to_json())))
    assert back == m
    assert CommModel.from_json(None) is None and CommModel.from_json({}) is None
    with pytest.raises(ValueError):
        CommModel.from_json({"version": 99, "fits": []})
    bad = m.to_json()
    bad["fits"][0]["algorithm"] = "butterfly"
    with pytest.raises(ValueError):
        CommModel.from_json(bad)
    newer = CommModel((replace(m.fits[0], segments=(Segment(0.0, 1e-6, 2e10),)),
                       Fit.line("all_reduce", "shm", "shm", 4, 2e-6, 1e10)), measured_at="2026-02-02")
    merged = m.merged(newer)
    keys = sorted((f.transport, f.world_size, f.alpha_s) for f in merged.fits)
    assert keys == [("gloo", 2, m.fits[1].alpha_s), ("shm", 2, 1e-6), ("shm", 4, 2e-6)]
    assert merged.measured_at == "2026-02-02"
    assert merged.get("all_reduce", "shm", 3).world_size == 4  # nearest n, ties to the larger
    assert math.isfinite(merged.predict("all_reduce", "shm", 1e6, 8))


def test_profile_stores_and_loads_comm_model(tmp_path, monkeypatch) -> None:
    from strata.hardware import probe as probe_mod
    from strata.hardware.profile import HardwareProfile

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    base = HardwareProfile(device="cpu", name="synthetic", cores=2, threads=2, isa=[], memory_bytes=2**34,
                           mem_bandwidth_gbs=30.0, linear_gbs={"float32": 20.0},
                           matmul_gflops={"float32": 50.0}, torch_version="x")
    # a profile cached before the comm model existed (no "comm_model" key) still loads
    old = base.to_json()
    del old["comm_model"]
    loaded = HardwareProfile.from_json(old)
    assert loaded.comm() is None and loaded == base
    path = probe_mod.profile_path("cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old))
    assert probe_mod.cached_comm_model("cpu") is None
    assert probe_mod.save_comm_model("cpu", _model()) == path
    assert probe_mod.cached_comm_model("cpu") == _model()
    stored = json.loads(path.read_text())
    assert stored["name"] == "synthetic" and stored["comm_model"]["fits"][0]["transport"] == "shm"
    # a re-probe keeps the measured comm model
    monkeypatch.setattr(probe_mod, "_measure", lambda identity: replace(base, name="re-measured"))
    again = probe_mod.probe("cpu", refresh=True)
    assert again.name == "re-measured" and again.comm() == _model()
    # a corrupt comm model makes the cache unreadable like any bad field (re-measured, not crashed)
    stored["comm_model"] = {"version": 1, "fits": [{"algorithm": "nope"}]}
    with pytest.raises((ValueError, KeyError)):
        HardwareProfile.from_json(stored)
