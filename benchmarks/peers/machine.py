"""The machine (`strata hw`: CPU, memory bandwidth, GEMM rates) and the software versions."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from .runner import Ctx, StepError
from .settings import REPO


def machine(ctx: Ctx) -> dict:
    m: dict[str, Any] = {"kernel": f"{platform.system()} {platform.release()}", "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                m["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        out = ctx.run("machine", "strata-hw", [*ctx.strata, "hw", "--json", "--refresh"], capture=True,
                      timeout=900)
        m["strata_hw"] = json.loads(out[out.find("{"):])
        m["hw_source"] = "strata hw --json --refresh"
    except (StepError, ValueError, subprocess.SubprocessError) as e:
        print(f"strata hw failed ({e}); falling back to strata.hardware.probe.probe()")
        from strata.hardware.probe import probe

        m["strata_hw"] = {"cpu_measured": probe(refresh=True).to_json(), "host": {}}
        m["hw_source"] = "strata.hardware.probe.probe(refresh=True)"
    from strata.cpuinfo import cpu_identity

    label = cpu_identity()["label"]
    if label:  # a VM's model name is often just "AMD EPYC": the numbers say which core
        m["cpu_note"] = label
    return m


def versions(ctx: Ctx) -> dict:
    v: dict[str, Any] = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "numpy", "numba"):
        try:
            out = subprocess.run([ctx.python, "-c", f"import {mod}; print({mod}.__version__)"],
                                 capture_output=True, text=True, timeout=120)
            v[mod] = out.stdout.strip() or "not installed"
        except (OSError, subprocess.SubprocessError):
            v[mod] = "?"
    try:
        v["strata_commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
        st = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True).stdout
        v["strata_dirty"] = bool(st.strip())
    except OSError:
        v["strata_commit"] = "?"
    for tool, key in (("cmake", "cmake_version"), ("cc", "compiler")):
        try:
            out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout
            v[key] = out.splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError, IndexError):
            v[key] = "?"
    return v
