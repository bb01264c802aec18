"""`strata hw`: host identity from sysfs, the GPU path with a fake torch.cuda and fake NVML, the
arch check, link-downgrade warnings, and the CLI (probe injected: tests never measure)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from strata.hardware import gpu_facts, host_facts, report
from strata.hardware.probe import HardwareProfile

PROFILE = HardwareProfile(
    device="cpu", name="synthetic CPU", cores=2, threads=2, isa=["avx2"], memory_bytes=8 * 2**30,
    mem_bandwidth_gbs=40.0, linear_gbs={"float32": 30.0}, matmul_gflops={"float32": 60.0},
    torch_version=torch.__version__, gemm_gflops={"float32": 180.0, "int8": 150.0},
    quant_linear_gbs={"int8": 28.0}, quant_matmul_gflops={"int8": 50.0}, dispatch_us=1.3,
    numpy_read_gbs=38.0, numpy_copy_gbs=31.0,
)
GPU_PROFILE = replace(PROFILE, device="cuda:0", name="NVIDIA H100 80GB HBM3", mem_bandwidth_gbs=2900.0,
                      gemm_gflops={"bfloat16": 700_000.0}, h2d_gbs=25.0, d2h_gbs=26.0, quant_linear_gbs={})


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cpu_caches_and_numa_from_sysfs(tmp_path) -> None:
    for cpu in (0, 1):
        base = tmp_path / "cpu" / f"cpu{cpu}" / "cache"
        for idx, (level, kind, size, shared) in enumerate([
            (1, "Data", "48K", str(cpu)), (1, "Instruction", "32K", str(cpu)), (2, "Unified", "2048K", str(cpu)),
            (3, "Unified", "32768K", "0-1"),
        ]):
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                _write(base / f"index{idx}" / name, f"{value}\n")
    caches = host_facts.cpu_caches([0, 1], tmp_path / "cpu")
    assert caches["L1d"] == {"bytes": 48 * 1024, "instances": 2}
    assert caches["L2"] == {"bytes": 2 * 2**20, "instances": 2}
    assert caches["L3"] == {"bytes": 32 * 2**20, "instances": 1}
    assert "L1i" in caches
    _write(tmp_path / "node" / "node0" / "cpulist", "0-1\n")
    _write(tmp_path / "node" / "node0" / "meminfo", "Node 0 MemTotal:       1024 kB\n")
    _write(tmp_path / "node" / "node1" / "cpulist", "2-3\n")
    nodes = host_facts.numa_nodes(tmp_path / "node")
    assert [n["node"] for n in nodes] == [0, 1] and nodes[0]["memory_bytes"] == 1024 * 1024
    assert host_facts.numa_nodes(tmp_path / "absent")[0]["node"] == 0


def test_host_info_fields() -> None:
    h = host_facts.host_info()
    for key in ("model", "cores_physical", "cores_logical", "cpus_usable", "cores_usable", "isa", "caches",
                "numa_nodes", "memory_total_bytes", "memory_available_bytes"):
        assert key in h
    assert {"avx2", "avx512f", "avx512_bf16", "amx_tile"} <= set(h["isa"])
    assert h["memory_total_bytes"] >= h["memory_available_bytes"] > 0


@pytest.mark.parametrize("cap,archs,ok,word", [
    ((9, 0), ["sm_80", "sm_90"], True, "sm_90 cubins"),
    ((8, 6), ["sm_80", "sm_90"], True, "binary-compatible"),
    ((8, 9), ["sm_70", "compute_70"], True, "JIT"),
    ((12, 0), ["sm_80", "sm_90", "sm_90a"], False, "no kernel image"),
    ((9, 0), ["sm_75", "sm_80"], False, "no kernel image"),
])
def test_arch_check(cap, archs, ok, word) -> None:
    r = gpu_facts.arch_check(cap, archs)
    assert r["ok"] is ok and word in r["how"]
    if not ok:
        assert f"sm_{cap[0]}{cap[1]}" in r["fix"] and "torch" in r["fix"]


def test_pcie_downgrade() -> None:
    assert gpu_facts.pcie_downgrade({"width_current": 8, "width_max": 16, "gen_current": 4, "gen_max": 4}) == \
        "running x8 of x16"
    assert "gen1 of gen5" in gpu_facts.pcie_downgrade({"width_current": 16, "width_max": 16, "gen_current": 1,
                                                    "gen_max": 5})
    assert gpu_facts.pcie_downgrade({"width_current": 16, "width_max": 16}) is None
    assert gpu_facts.pcie_downgrade({}) is None


def test_no_gpu_path(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_facts.gpu_devices() == []
    monkeypatch.setattr(report, "probe", lambda device="cpu", refresh=False: PROFILE)
    text = report.format_report(report.build_report())
    assert "GPUs: none visible" in text and "numpy read 38.0" in text and "dispatch" in text


class FakeNVML:
    """Enough of pynvml for two GPUs joined by two NVLink links, GPU 1 on a x8 link."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_NVLINK_MAX_LINKS = 0, 1, 4
    BUS = {0: "00000000:18:00.0", 1: "00000000:2A:00.0"}

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return next(i for i, b in self.BUS.items() if b.lower() == bus.lower())

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetClockInfo(self, h, c):
        return 1980 if c == 0 else 2619

    def nvmlDeviceGetMaxClockInfo(self, h, c):
        return 1980 if c == 0 else 2619

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return 8 if h == 1 else 16

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 2:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        return 4

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h, link):
        return SimpleNamespace(busId=self.BUS[1 - h].encode())


def _fake_cuda(monkeypatch, arch_list) -> None:
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9, minor=0,
                             multi_processor_count=132, L2_cache_size=50 * 2**20, pci_bus_id=bus,
                             pci_domain_id=0, pci_device_id=0) for bus in (0x18, 0x2A)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)


def test_gpu_path_with_fake_cuda_and_nvml(monkeypatch) -> None:
    _fake_cuda(monkeypatch, ["sm_80", "sm_90"])
    monkeypatch.setattr(gpu_facts, "_load_nvml", lambda: FakeNVML())
    for mod in (report, gpu_facts):  # the CPU's figures, the GPUs'
        monkeypatch.setattr(mod, "probe", lambda device="cpu", refresh=False: GPU_PROFILE if "cuda" in device
                            else PROFILE)
    r = report.build_report()
    gpus = r["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["compute_capability"] == "9.0" and gpus[0]["sms"] == 132 and gpus[0]["arch"]["ok"]
    assert gpus[1]["pcie"]["downgraded"] == "running x8 of x16" and gpus[0]["pcie"]["downgraded"] is None
    assert [link["peer_gpu"] for link in gpus[0]["nvlink"]] == [1, 1]
    assert "matmul_allow_tf32" in gpus[0]["tf32"]
    text = report.format_report(r)
    assert "running x8 of x16" in text and "2 active links" in text and "2 to GPU 1" in text
    assert "bf16 GEMM    700.0 TFLOP/s" in text and "H2D 25.0 GB/s" in text
    json.dumps(r)  # plain data


def test_gpu_path_no_kernel_image_and_no_nvml(monkeypatch) -> None:
    _fake_cuda(monkeypatch, ["sm_70", "sm_75"])
    monkeypatch.setattr(gpu_facts, "_load_nvml", lambda: None)
    monkeypatch.setattr(gpu_facts, "probe", lambda *a, **k: pytest.fail("must not measure an unusable GPU"))
    gpus = gpu_facts.gpu_devices()
    text = "\n".join(report._gpu_lines(gpus[0]))
    assert "PROBLEM" in text and "sm_90" in text and "fix" in text and "nvidia-ml-py" in text


def test_load_nvml_absent(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert gpu_facts._load_nvml() is None


def test_cli_hw_json(monkeypatch, capsys) -> None:
    from strata.cli import main

    monkeypatch.setattr(report, "probe", lambda device="cpu", refresh=False: PROFILE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["hw", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host"]["caches"] is not None and out["cpu_measured"]["numpy_read_gbs"] == 38.0
    assert out["gpus"] == []
    assert main(["hw"]) == 0
    assert "DRAM read" in capsys.readouterr().out
