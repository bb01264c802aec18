"""Fixed settings: paths, the llama.cpp version and build flags, shapes, parts, workloads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_MD = REPO / "docs" / "benchmarks.md"
DEFAULT_JSON = HERE / "results.json"

LCP_VERSION = "0.3.36"  # llama-cpp-python sdist on PyPI; its vendor/llama.cpp is the peer
BUILD_TARGETS = ("llama-bench", "llama-server")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: this CPU's AVX-512 / VNNI / BF16
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries in the cache
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS client: nothing is downloaded at run time
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # the server's web UI would be fetched from Hugging Face
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
EXTRA_TARGETS = ("llama-quantize",)  # built into the same tree when missing (incremental, ~1 min)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # written by convert_hf_to_gguf.py
QUANTIZED = {"q4_0": "f32"}  # written by llama-quantize from the GGUF of this outtype
STRATA_REPEATS = 3  # timed runs per Strata/transformers latency measurement; the report shows the median
GGUF_TYPES = (*OUTTYPES, *QUANTIZED)
# Rebuilt with these when the native build crashes (SIGILL, SIGSEGV, SIGBUS) in its verify
# step, as it did on a Xeon VM whose AMX tiles the guest could not use.
# GGML_NATIVE builds with -march=native, whose __AMX_INT8__ macros compile ggml's AMX code in
# whatever the GGML_AMX_* options say: the explicit -mno-amx-* flags (which GCC lets override
# -march in any order) are what turn it off.
_NO_AMX_ISA = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_FLAGS = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                f"-DCMAKE_C_FLAGS={_NO_AMX_ISA}", f"-DCMAKE_CXX_FLAGS={_NO_AMX_ISA}")
ALL_SHAPES = ("smol-135m", "qwen-0.5b")
PARTS = ("latency", "throughput", "serving")
RATE_FACTORS = {"low": 0.3, "near": 0.9, "over": 1.5}  # x the saturation request rate


# ----------------------------------------------------------------------------------------------
# workloads


@dataclass(frozen=True)
class Workload:
    lat_in: int = 128
    lat_out: int = 128
    bench_reps: int = 3  # llama-bench repetitions
    tp_prompts: int = 64
    tp_in: tuple[int, int] = (32, 512)
    tp_out: tuple[int, int] = (32, 256)
    serve_target_s: float = 80.0  # arrivals span about this long at each serving point
    serve_min_prompts: int = 12
    serve_max_prompts: int = 64
    hf_batch: int = 16


FULL = Workload()
QUICK = Workload(lat_in=32, lat_out=16, bench_reps=1, tp_prompts=8, tp_in=(16, 64), tp_out=(8, 32),
                 serve_target_s=8.0, serve_min_prompts=4, serve_max_prompts=8)


def rng_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"
