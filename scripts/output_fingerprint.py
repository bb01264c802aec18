"""Greedy and seeded outputs of the demo model and the random shapes, in every weight format, as
JSON: run it before and after a change that must not change behaviour, and compare the files.

    .venv/bin/python scripts/output_fingerprint.py before.json      # on the old checkout
    .venv/bin/python scripts/output_fingerprint.py after.json       # on the new one
    cmp before.json after.json

Cases: the demo model and the tiny / smol-135m / qwen-0.5b random shapes; fp32, bf16, int8 and int4
weights; fp32 ("auto") and bf16 KV caches; one prompt alone and four of different lengths batched;
greedy and seeded top-p sampling, 24 tokens each. One line per case (its hash) goes to stdout.
The random checkpoints are written under $STRATA_CACHE once (qwen-0.5b: ~2 GB)."""

from __future__ import annotations

import hashlib
import json
import sys

from strata import LLM, SamplingParams
from strata.demo.random_models import random_model_path

SHAPES = (None, "tiny", "smol-135m", "qwen-0.5b")  # None: the demo model
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),
}


def case(model: str | None, quantization: str | None, kv: str) -> dict:
    llm = LLM(model, dtype="float32", quantization=quantization, kv_cache_dtype=kv, max_model_len=512, max_num_seqs=8)
    try:
        vocab = llm.engine.model_config.vocab_size
        prompts = [[(7 * i + 13 * j + 5) % vocab for i in range(n)] for j, n in enumerate((5, 17, 40, 9))]
        out = {}
        for mode, params in PARAMS.items():
            one = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
            batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            out[mode] = [o.outputs[0].token_ids for o in one + batch]
        return out
    finally:
        llm.close()


def main(path: str) -> None:
    results = {}
    for shape in SHAPES:
        model = None if shape is None else str(random_model_path(shape))
        for quantization in (None, "bf16", "int8", "int4"):
            for kv in ("auto", "bfloat16"):
                key = f"{shape or 'demo'}/{quantization}/{kv}"
                results[key] = case(model, quantization, kv)
                print(key, hashlib.sha1(json.dumps(results[key]).encode()).hexdigest()[:12], flush=True)
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
