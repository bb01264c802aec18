"""Fixtures for the training tests: a tiny Llama config on the demo tokenizer, a small corpus
cut from the repository's Shakespeare texts, and helpers that run `strata train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata.demo.model import demo_config

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "shakespeare"
TRAIN_TIMEOUT_S = 180


@pytest.fixture(scope="session")
def tiny_train_dir(tmp_path_factory) -> Path:
    """config.json of a 2-layer Llama (GQA, tied embeddings) on the demo tokenizer, plus
    train.txt / eval.txt (~40 KB / ~10 KB of Shakespeare)."""
    d = tmp_path_factory.mktemp("tiny-train")
    cfg = demo_config()
    cfg.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, head_dim=16, max_position_embeddings=256)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "train.txt").write_text((CORPUS / "train" / "hamlet.txt").read_text()[:40_000])
    (d / "eval.txt").write_text((CORPUS / "heldout" / "julius_caesar.txt").read_text()[:10_000])
    return d


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_train_dir, tmp_path_factory) -> Path:
    """config.json of a 2-layer Qwen3-MoE (8 experts, top 2, q/k norms) on the demo tokenizer, and
    the tiny Llama's train.txt."""
    d = tmp_path_factory.mktemp("tiny-moe")
    cfg = demo_config()
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=32,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               intermediate_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               norm_topk_prob=True, router_aux_loss_coef=0.01, max_position_embeddings=256)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "train.txt").write_text((tiny_train_dir / "train.txt").read_text())
    return d


def train_argv(d: Path, out: Path, *extra: str) -> list[str]:
    """`strata train` arguments for the tiny model; `extra` overrides (argparse: last one wins)."""
    return ["train", "--model", str(d / "config.json"), "--data", str(d / "train.txt"),
            "--out-dir", str(out), "--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "5",
            "--warmup-steps", "1", "--log-every", "1", "--precision", "float32", "--num-workers", "0",
            "--no-tensorboard", "--threads", "1", *extra]


def run_train_subprocess(argv: list[str], timeout: float = TRAIN_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "strata", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def metrics(out: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a step logged twice (a killed run, then its resume) keeps the last."""
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            rows[row["step"]] = row
    return rows
