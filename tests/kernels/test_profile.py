"""Hotspot report (kernels/profile.py): five rows with shares of step time, a host-overhead share,
numba kernels as named ops, a Chrome trace, and `strata bench latency --profile` with JSON."""

from __future__ import annotations

import json

import pytest

from strata import SamplingParams
from strata.kernels import cpu_gemv, dispatch
from strata.kernels.profile import _kernel_entry_points, named_kernels, profile_decode


def _check(report: dict | object) -> None:
    r = report if isinstance(report, dict) else report.to_dict()
    assert len(r["rows"]) == 5
    for row in r["rows"]:
        assert 0.0 <= row["share"] <= 1.0 and row["calls_per_step"] > 0
    assert 0.0 <= r["host_overhead_share"] <= 1.0
    assert sum(row["share"] for row in r["rows"]) + r["host_overhead_share"] <= 1.0 + 1e-9
    assert r["kernel_ms"] + r["host_overhead_ms"] == pytest.approx(r["step_ms"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("fuse", [False, True])
def test_profile_report(llama, llm_factory, prompt_of, tmp_path, fuse):
    llm = llm_factory(llama, max_num_seqs=2, fuse=fuse)
    prompts = [prompt_of(1, 12), prompt_of(2, 7)]
    trace = tmp_path / "decode.json"
    report = profile_decode(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            trace=str(trace))
    _check(report)
    assert report.steps == 5  # tokens 2..6 of each sequence: the decode steps after the prefill
    names = {r.name for r in report.rows}
    # the kernels dominate, and show up under their names
    if fuse:  # the FX-fused forward: one op per kernel, the GEMVs among them
        assert "numba::gemv" in names
        assert any(n.startswith("strata::") or n.startswith("numba::") for n in names)
    else:  # the fused CPU decode step: the layers (GEMVs inside), the LM head with the final norm
        assert {"numba::decode_layer", "numba::decode_head"} <= names
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "strata::decode_step" for e in events)
    assert not llm.engine.has_unfinished()


def test_named_kernels_names_every_entry_point_without_patching():
    """Each numba entry point is one decorated function (kernels/dispatch.kernel) carrying its range
    name; named_kernels() switches the naming on for this context and patches nothing."""
    entry = {(mod.__name__, attr): getattr(mod, attr) for mod, attr, _ in _kernel_entry_points()}
    for mod, attr, label in _kernel_entry_points():
        fn = getattr(mod, attr)
        assert fn.kernel_name == label and callable(fn.__wrapped_kernel__)
    before = cpu_gemv.gemv
    with named_kernels():
        assert dispatch.current().named
        assert cpu_gemv.gemv is before
    assert not dispatch.current().named
    assert {(mod.__name__, attr): getattr(mod, attr) for mod, attr, _ in _kernel_entry_points()} == entry


def test_bench_latency_profile_json(llama, tmp_path, capsys):
    from strata.cli import main

    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", str(llama.path), "--dtype", "float32", "--threads", "1",
               "--input-len", "8", "--output-len", "6", "--profile", "--trace", str(tmp_path / "t.json"),
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "decode hotspots" in printed and "host overhead" in printed
    data = json.loads(out.read_text())
    _check(data["strata"]["profile"])
    assert (tmp_path / "t.json").is_file()
