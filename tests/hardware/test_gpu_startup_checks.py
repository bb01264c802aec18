"""`strata serve`'s GPU start-up checks as pure functions of fake facts (no GPU here), and their
wiring: warnings with the fix in the log, gauges in /metrics, nothing at all on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from strata.hardware import startup_checks as sc
from strata.hardware.startup_checks import GpuFacts
from strata.server import main
from strata.server.metrics import Metrics

H100 = GpuFacts(0, "NVIDIA H100 80GB HBM3", (9, 0), {"gen_current": 5, "gen_max": 5, "gen_gpu_max": 5,
                                                    "width_current": 16, "width_max": 16})


def _series(m: Metrics, name: str) -> dict[str, float]:
    out = {}
    for line in m.render().decode().splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(value)
    return out


@pytest.mark.parametrize(("archs", "ok", "words"), [
    (["sm_80", "sm_86", "sm_90"], True, "sm_90 cubins"),
    (["sm_70", "sm_75", "sm_80", "compute_80"], True, "PTX compute_80 JIT"),
    (["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86"], False, "no kernel image for sm_90"),
])
def test_kernel_image(archs, ok, words) -> None:
    c = sc.kernel_image_check(H100, archs)
    assert c.ok is ok and words in c.detail and c.check == "kernel_image"
    assert (c.fix is None) is ok
    if not ok:
        assert "sm_90" in c.fix


@pytest.mark.parametrize(("pcie", "ok", "words"), [
    ({"gen_current": 5, "gen_max": 5, "gen_gpu_max": 5, "width_current": 16, "width_max": 16}, True, "gen5 of gen5, x16"),
    ({"gen_current": 1, "gen_max": 5, "gen_gpu_max": 5, "width_current": 16, "width_max": 16}, True, "normal"),
    ({"gen_current": 5, "gen_max": 5, "width_current": 8, "width_max": 16}, False, "running x8 of x16 lanes"),
    ({"gen_current": 4, "gen_max": 4, "gen_gpu_max": 5, "width_current": 16, "width_max": 16}, False,
     "the slot caps the link at gen4, the GPU does gen5"),
    ({}, True, "not reported"),
])
def test_pcie_link(pcie, ok, words) -> None:
    c = sc.pcie_check(GpuFacts(1, "x", (9, 0), pcie))
    assert c.ok is ok and words in c.detail and c.device == "1"
    if not ok:
        assert c.fix and "downgraded" in c.detail


def test_tf32() -> None:
    warn = sc.tf32_check(H100, "torch.float32", False, "highest")
    assert not warn.ok and "full fp32" in warn.detail and "--dtype bfloat16" in warn.fix
    assert sc.tf32_check(H100, "float32", True, "highest").ok
    assert sc.tf32_check(H100, "float32", False, "high").ok
    assert sc.tf32_check(H100, "float32", False, "highest", cublas_override=True).ok
    assert "TF32 does not apply" in sc.tf32_check(H100, "torch.bfloat16", False, "highest").detail
    t4 = GpuFacts(0, "Tesla T4", (7, 5))
    assert sc.tf32_check(t4, "float32", False, "highest").ok


def test_parse_nvidia_smi_and_sysfs(tmp_path) -> None:
    csv = ("0, NVIDIA H100 80GB HBM3, 9.0, 00000000:19:00.0, 5, 5, 5, 16, 16\n"
           "1, NVIDIA H100 80GB HBM3, 9.0, 00000000:3B:00.0, 1, 4, 5, 8, 16\n"
           "2, Some GPU, [N/A], 00000000:5D:00.0, 1, 4, 5, 8, 16\n")
    facts = sc.parse_nvidia_smi(csv)
    assert [f.index for f in facts] == [0, 1]  # no compute capability: not a usable row
    assert facts[1].pcie == {"gen_current": 1, "gen_max": 4, "gen_gpu_max": 5, "width_current": 8, "width_max": 16}
    checks = sc.device_checks(facts, ["sm_90"])
    assert [(c.check, c.device, c.ok) for c in checks] == [
        ("kernel_image", "0", True), ("pcie_link", "0", True), ("kernel_image", "1", True), ("pcie_link", "1", False)]
    older = tuple(f for f in sc.NVIDIA_SMI_FIELDS if f != "pcie.link.gen.gpumax")  # drivers without gen.gpumax
    f = sc.parse_nvidia_smi("0, L4, 8.9, 00000000:19:00.0, [N/A], 4, 16, 16\n", older)[0]
    assert f.capability == (8, 9) and f.pcie["gen_current"] is None and f.pcie["gen_gpu_max"] is None

    dev = tmp_path / "0000:19:00.0"
    dev.mkdir()
    for name, text in (("current_link_speed", "8.0 GT/s PCIe"), ("max_link_speed", "16.0 GT/s PCIe"),
                       ("current_link_width", "8"), ("max_link_width", "16")):
        (dev / name).write_text(text + "\n")
    assert sc.sysfs_pcie("0000:19:00.0", tmp_path) == {"gen_current": 3, "gen_max": 4, "width_current": 8,
                                                       "width_max": 16}
    assert sc.sysfs_pcie("0000:99:00.0", tmp_path) == {"gen_current": None, "gen_max": None, "width_current": None,
                                                       "width_max": None}


def test_serve_runs_them_on_cuda_only(monkeypatch, caplog) -> None:
    m = Metrics()
    assert main.gpu_device_checks({"device": "cpu"}, m) == []
    assert not _series(m, "strata_gpu_check_warning")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_70", "sm_80"])
    narrow = GpuFacts(0, "NVIDIA H100 80GB HBM3", (9, 0), {"gen_current": 5, "gen_max": 5, "width_current": 8,
                                                           "width_max": 16})
    monkeypatch.setattr(sc, "gather_facts", lambda: [narrow])
    with caplog.at_level(logging.INFO, logger="strata.hardware.startup_checks"):
        facts = main.gpu_device_checks({"device": "cuda"}, m)
        main.gpu_tf32_checks(facts, {"dtype": "torch.float32"}, m)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3
    assert any("no kernel image for sm_90" in w and "fix:" in w for w in warnings)
    assert any("running x8 of x16" in w for w in warnings) and any("TF32" in w for w in warnings)
    assert _series(m, "strata_gpu_check_warning") == {
        '{check="kernel_image",device="0"}': 1.0, '{check="pcie_link",device="0"}': 1.0, '{check="tf32",device="0"}': 1.0}
    info = _series(m, "strata_gpu_check_info")
    assert len(info) == 3 and all('status="warn"' in k for k in info)
    # a check run again replaces its info series (one per check and device)
    m.gpu_checks([sc.GpuCheck("tf32", "0", True, "fp32 matmuls use TF32 tensor cores")])
    info = _series(m, "strata_gpu_check_info")
    assert len(info) == 3 and sum('check="tf32"' in k and 'status="ok"' in k for k in info) == 1
    assert _series(m, "strata_gpu_check_warning")['{check="tf32",device="0"}'] == 0.0


def test_unreadable_facts_skip_the_checks_not_the_server(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken():
        raise RuntimeError("driver/library version mismatch")

    monkeypatch.setattr(sc, "gather_facts", broken)
    m = Metrics()
    with caplog.at_level(logging.WARNING, logger="strata.server"):
        assert main.gpu_device_checks({"device": "cuda:0"}, m) == []
    assert "GPU start-up checks skipped" in caplog.text and "version mismatch" in caplog.text
    main.gpu_tf32_checks([], {"dtype": "torch.float32"}, m)  # nothing to check: no series
    assert not _series(m, "strata_gpu_check_warning")
