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
SMALL_SHAPES = ("smol-135m", "qwen-0.5b")  # fp32 single-file checkpoints: every precision, transformers too
# bf16-sharded checkpoints (strata.demo.random_models.BF16_SHAPES): the latency part only, no fp32 and no
# transformers row (an fp32 copy of 3-8B weights is what nobody runs on a CPU), and for the 8B shape
# int4 alone (the precision a 2-core, 23 GiB machine would run it in). The mixture-of-experts shape
# (qwen3-moe-2b: Qwen3-MoE, 2.03B parameters stored, 0.33B active a token; demo/shapes.py) is the
# exception: its fp32 copy (8.1 GB) fits, so it runs every format, transformers' fp32 row included.
BIG_SHAPES = ("llama-3.2-3b", "llama-3.1-8b", "qwen3-moe-2b")
ALL_SHAPES = (*SMALL_SHAPES, *BIG_SHAPES)
# Default --shapes, sized to keep a full run (every part, defaults) near 50 min on the 2-core dev
# VM; the 16k depth rows push the estimate to ~60 min. From the run in results.json (26.5 min:
# smol-135m latency 4.0, qwen-0.5b latency 10.4, throughput + serving 11.6) and a --quick smoke of
# the new rows (2026-12-07: llama-3.2-3b Strata runs 22-28 s each incl. load, llama-bench 3-8 s;
# llama-3.1-8b int4 Strata 40 s; qwen-0.5b at a 16k context: one llama-bench run 234-247 s with
# f16 KV, > 9 min with q8_0 KV (stopped there; at 4k q8_0 took 63 s to f16's 33 s), one Strata
# run 216 s = warm-up + timed, each a 16k prefill):
#   llama-3.2-3b latency, 2 rounds x (bf16 + int8 + int4), 64 output tokens, 2 repetitions: ~9 min
#     (weights 6.4 GB bf16 = 6.5x qwen-0.5b's, 3.4 GB q8_0, 1.9 GB q4_0; decode is bandwidth-bound)
#   depth part, qwen-0.5b at 0 / 4k / 16k, bf16 + int8 KV, 1 round, llama.cpp unbracketed: ~24 min,
#     ~21 of them the four 16k rows (llama.cpp f16 ~4 min, q8_0 ~9-10 min, Strata ~3.6 min each)
#   total ~60 min; `--big-latency-rounds 1` takes ~4.5 min off, `--depths 0,4k` ~21 min,
#   `--depth-bracket` adds ~14 min and each further --depth-rounds ~24 min.
#   llama-3.1-8b int4 is opt-in (`--shapes ...,llama-3.1-8b`): ~4.5 more min (2 rounds; 4.4 GB
#   q4_0; Strata reads the 16 GB bf16 checkpoint each run).
DEFAULT_SHAPES = ("smol-135m", "qwen-0.5b", "llama-3.2-3b")
# Strata formats measured per shape (parts.LATENCY_PAIRS' tags); the small shapes run all of them.
BIG_PRECISIONS = {"llama-3.2-3b": ("bf16", "int8", "int4"), "llama-3.1-8b": ("int4",),
                  "qwen3-moe-2b": ("fp32", "bf16", "int8", "int4")}
# GGUF files of a big shape: what convert_hf_to_gguf.py writes from the bf16 checkpoint (a bf16 GGUF is
# lossless from it), what llama-quantize writes from that bf16 GGUF (the same blocks of 32 as the
# converter's q8_0, in C++ and threaded), and the intermediates deleted once those exist.
BIG_GGUFS: dict[str, dict] = {
    "llama-3.2-3b": {"outtypes": ("bf16",), "quantized": {"q8_0": "bf16", "q4_0": "bf16"}, "drop": ()},
    # the int4 row alone: convert to a bf16 GGUF (16 GB), quantise that to q4_0 (4.7 GB), then delete
    # the bf16 GGUF (nothing reads it; it would hold 16 GB of the VM's ~60 GB free disk)
    "llama-3.1-8b": {"outtypes": ("bf16",), "quantized": {"q4_0": "bf16"}, "drop": ("bf16",)},
    # every format: f32 (8.1 GB, the fp32 row's peer) and bf16 (4.1 GB) from the converter, q8_0 / q4_0
    # quantised from the bf16 one (convert_hf_to_gguf.py writes Qwen3MoeForCausalLM as qwen3moe)
    "qwen3-moe-2b": {"outtypes": ("f32", "bf16"), "quantized": {"q8_0": "bf16", "q4_0": "bf16"}, "drop": ()},
}


def gguf_plan(shape: str) -> tuple[tuple[str, ...], dict[str, str], tuple[str, ...]]:
    """(converter outtypes, {llama-quantize type: source outtype}, outtypes deleted afterwards) of a shape."""
    big = BIG_GGUFS.get(shape)
    if big is None:
        return OUTTYPES, dict(QUANTIZED), ()
    return big["outtypes"], dict(big["quantized"]), big["drop"]


def gguf_types(shape: str) -> tuple[str, ...]:
    """The GGUF types a shape's benchmark rows read (its plan less what is deleted)."""
    outtypes, quantized, drop = gguf_plan(shape)
    return tuple(t for t in (*outtypes, *quantized) if t not in drop)


DEPTH_CAPABLE = tuple(s for s in ALL_SHAPES if "bf16" in gguf_types(s))  # the depth rows read the bf16 GGUF


def precisions(shape: str) -> tuple[str, ...] | None:
    """Strata formats (LATENCY_PAIRS tags) a shape's latency part measures; None: all of them."""
    return BIG_PRECISIONS.get(shape)


def parse_shapes(text: str, known: tuple[str, ...] = ALL_SHAPES) -> list[str]:
    """'a,b' -> ['a', 'b'] in the order given, duplicates dropped; ValueError naming unknown ones."""
    shapes = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [s for s in shapes if s not in known]
    if bad:
        raise ValueError(f"unknown shape(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return shapes


def parse_depths(text: str) -> list[int]:
    """'0,4096,16384' (k suffix allowed: '4k') -> sorted distinct depths >= 0."""
    out = set()
    for part in filter(None, (x.strip().lower() for x in text.split(","))):
        n = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        if n < 0:
            raise ValueError(f"depth must be >= 0, got {n}")
        out.add(n)
    return sorted(out)


PARTS = ("latency", "depth", "throughput", "serving")
DEPTH_SHAPES = ("qwen-0.5b",)  # the depth part's default --depth-shapes
DEPTHS = (0, 4096, 16384)  # the depth part's default --depths (context tokens before the decode)
# qwen-0.5b's random shape says max_position_embeddings 4096 (Strata refuses a longer max_model_len);
# Qwen2.5-0.5B itself says 32768. The depth part runs Strata on a copy of the checkpoint directory
# (symlinks to the same weights and tokenizer) whose config.json says this, under $PEERS/models/.
DEPTH_CONTEXT = 32768
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
    # the big shapes (BIG_SHAPES): fewer output tokens and repetitions (a 3B bf16 decode step is ~6x
    # qwen-0.5b's), and --big-latency-rounds rounds instead of --latency-rounds
    big_lat_out: int = 64
    big_bench_reps: int = 2  # llama-bench repetitions
    big_repeats: int = 2  # Strata's timed runs (strata bench latency --repeats)
    # the depth part: decode this many tokens after a context of each depth, one llama-bench
    # repetition (after its own warm-up) and one Strata run after one warm-up run a round
    depth_out: int = 64
    depth_bench_reps: int = 1
    depths: tuple[int, ...] = DEPTHS


FULL = Workload()
QUICK = Workload(lat_in=32, lat_out=16, bench_reps=1, tp_prompts=8, tp_in=(16, 64), tp_out=(8, 32),
                 serve_target_s=8.0, serve_min_prompts=4, serve_max_prompts=8,
                 big_lat_out=16, big_bench_reps=1, big_repeats=1, depth_out=16, depths=(0, 512))


def rng_text(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"
