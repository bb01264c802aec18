"""Strata's STRATA_* environment variables: every one is read here, nowhere else.

`SETTINGS.<name>` reads its variable when asked (a test or a user flips a switch between runs in
one process; each read is one os.environ lookup), typed, with its default. SWITCHES lists them
for the README's table (tests/test_settings.py keeps the two and the code in step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

OFF = ("0", "false", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    default: str
    meaning: str


SWITCHES = (
    Switch("STRATA_CACHE", "~/.cache/strata", "where the demo model, random checkpoints and the hardware profile live"),
    Switch("STRATA_FUSED_DECODE", "on", "the CPU decode step runs each Llama-shaped layer in one compiled call "
           "(0: the eager per-kernel path)"),
    Switch("STRATA_MULTI_STEP", "on", "CPU: the automatic count of decode steps per scheduler call (0: one step a call)"),
    Switch("STRATA_ADAPTIVE_THREADS", "on", "CPU: the decode kernels' thread count follows measured steps (0: fixed)"),
    Switch("STRATA_ADAPTIVE_PREFILL_CAP", "on", "`strata serve` on CPU: the decode-first prefill cap is lowered while "
           "measured mixed steps run long (0: the start-up cap)"),
    Switch("STRATA_PREFILL_GEMM", "auto", "CPU prefill GEMM: auto (by measurement), aten or onednn (every weight on "
           "that fp32 GEMM, exact), bf16 (narrow weights through the bf16 GEMM)"),
    Switch("STRATA_INT8_PREFILL", "(unset)", "w8a8: int8 weights' prefill with int8 activations (opt-in)"),
    Switch("STRATA_INT4_PREFILL", "w8a8", "int4 weights' prefill: w8a8 (int8 activations) or dequant"),
    Switch("STRATA_GROUP32_PREFILL", "fast", "group-32 weights' prefill (a GGUF's Q8_0 / Q4_0): fast (the prefill GEMM "
           "measured fastest) or q8_0 (llama.cpp's q8_0 activation rounding, as decode: integer kernels, slower)"),
    Switch("STRATA_INT8_FP32_ACTIVATIONS", "0", "1: int8 (and int4) kernels keep fp32 activations (no VNNI, no W8A8)"),
    Switch("STRATA_INT4_FP32_ACTIVATIONS", "0", "1: int4 kernels keep fp32 activations (no VNNI, no W8A8)"),
    Switch("STRATA_HOST_MALLOC", "on", "CPU: glibc keeps freed activation memory instead of returning it per step"),
    Switch("STRATA_API_KEY", "(unset)", "`strata serve`: the bearer token every request must carry (or --api-key)"),
    Switch("STRATA_SHM_SPIN", "200", "tensor parallelism on one host: flag polls before a shared-memory wait yields"),
    Switch("STRATA_RANK_THREADS", "(set by Strata)", "internal: `strata bench comm` ranks' compute threads"),
    Switch("STRATA_PARENT_PID", "(set by Strata)", "internal: a child process's parent, so it exits with it"),
    Switch("STRATA_TEST_FAULTS", "(unset)", "tests only: faults the server injects (e.g. tokenize_delay=0.5)"),
)


def _on(name: str) -> bool:
    """On unless the variable says off ("0", "false" or "off")."""
    return os.environ.get(name, "") not in OFF


def _set(name: str) -> bool:
    """Off unless the variable is set to something other than "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")


class Settings:
    """The STRATA_* variables as typed properties, read live."""

    @property
    def cache(self) -> Path | None:
        value = os.environ.get("STRATA_CACHE")
        return Path(value).expanduser() if value else None

    @property
    def fused_decode(self) -> bool:
        return _on("STRATA_FUSED_DECODE")

    @property
    def multi_step(self) -> bool:
        return _on("STRATA_MULTI_STEP")

    @property
    def adaptive_threads(self) -> bool:
        return _on("STRATA_ADAPTIVE_THREADS")

    @property
    def adaptive_prefill_cap(self) -> bool:
        return _on("STRATA_ADAPTIVE_PREFILL_CAP")

    @property
    def host_malloc(self) -> bool:
        return _on("STRATA_HOST_MALLOC")

    @property
    def prefill_gemm(self) -> str:
        return os.environ.get("STRATA_PREFILL_GEMM", "auto") or "auto"

    @property
    def int8_prefill(self) -> str:
        return os.environ.get("STRATA_INT8_PREFILL", "")

    @property
    def int4_prefill(self) -> str:
        return os.environ.get("STRATA_INT4_PREFILL", "w8a8") or "w8a8"

    @property
    def group32_prefill(self) -> str:
        return os.environ.get("STRATA_GROUP32_PREFILL", "fast") or "fast"

    @property
    def int8_fp32_activations(self) -> bool:
        return _set("STRATA_INT8_FP32_ACTIVATIONS")

    @property
    def int4_fp32_activations(self) -> bool:
        return _set("STRATA_INT4_FP32_ACTIVATIONS")

    @property
    def api_key(self) -> str | None:
        return os.environ.get("STRATA_API_KEY") or None

    @property
    def shm_spin(self) -> int:
        return int(os.environ.get("STRATA_SHM_SPIN", "200"))

    @property
    def rank_threads(self) -> int:
        return int(os.environ.get("STRATA_RANK_THREADS", "1"))

    @property
    def parent_pid(self) -> int | None:
        value = os.environ.get("STRATA_PARENT_PID")
        return int(value) if value else None

    @property
    def test_faults(self) -> str:
        return os.environ.get("STRATA_TEST_FAULTS", "")


SETTINGS = Settings()
