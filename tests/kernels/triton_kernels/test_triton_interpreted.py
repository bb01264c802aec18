"""Each Triton kernel, run by Triton's interpreter on CPU tensors, against its torch twin.

The interpreter must be chosen before triton is imported (TRITON_INTERPRET=1), and this process
may already have imported triton (or must not interpret: on a GPU machine the same session runs
compiled kernels), so the cases run in one child process (triton_cases.py) and each case's result
becomes one test here. Skipped only when triton is not installed.

(This directory is not called tests/kernels/triton: pytest puts tests/kernels on sys.path for the
CPU kernel tests, and a directory named "triton" there would import as a namespace package named
triton wherever the real one is not installed.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.language")  # "triton" alone could resolve to a namespace package

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("triton_cases", HERE / "triton_cases.py")
triton_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triton_cases)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("triton_interp") / "results.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_cases.py"), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    if not out.exists():
        pytest.fail(f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(triton_cases.CASES))
def test_kernel_matches_twin_interpreted(case, interpreted):
    result = interpreted[case]
    assert result["ok"], result["error"]
