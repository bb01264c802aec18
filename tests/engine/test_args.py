"""EngineArgs: one home for every engine flag, its default and model resolution."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from strata.cli import build_parser
from strata.config import EngineConfig, engine_default
from strata.engine.args import FLAGS, EngineArgs
from strata.errors import ConfigError


def _parse(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    return p.parse_args(list(flags))


def test_defaults_are_engine_config_defaults():
    assert EngineArgs.from_cli_args(_parse()).create_engine_config() == EngineConfig()
    assert EngineArgs.from_cli_args(_parse()).overrides == {}
    args = _parse()
    for f in FLAGS:
        assert getattr(args, f.field) == engine_default(f.field), f.field


def test_every_flag_reaches_its_field():
    args = _parse("--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory", "1MiB",
                  "--memory-fraction", "0.25", "--block-size", "8", "--max-num-seqs", "3",
                  "--max-num-batched-tokens", "99", "--threads", "1", "--attention-backend", "torch",
                  "--quantization", "int4", "--quantization-group-size", "128", "--no-prefix-caching",
                  "--preemption-mode", "swap", "--swap-space", "2MiB", "--no-fuse", "--kv-cache-dtype", "bf16")
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert (cfg.dtype, cfg.max_model_len, cfg.kv_cache_memory, cfg.memory_fraction) == ("float32", 64, 2**20, 0.25)
    assert (cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_threads) == (8, 3, 99, 1)
    assert (cfg.attention_backend, cfg.quantization, cfg.quantization_group_size) == ("torch", "int4", 128)
    assert cfg.enable_prefix_caching is False and cfg.fuse is False
    assert (cfg.preemption_mode, cfg.swap_space, cfg.kv_cache_dtype) == ("swap", 2 * 2**20, "bfloat16")
    assert EngineArgs.from_cli_args(_parse("--compile")).create_engine_config().compile is True
    assert EngineArgs.from_cli_args(_parse("--fuse")).create_engine_config().fuse is True


def test_every_config_field_but_model_and_seed_has_a_flag():
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "seed"}
    assert {f.field for f in FLAGS} == fields


def test_help_shows_the_config_default():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    text = p.format_help()
    assert f"(default: {engine_default('block_size')})" in text
    assert f"(default: {engine_default('max_num_batched_tokens')})" in text


def test_to_cli_round_trips():
    given = _parse("--random-model", "tiny", "--max-num-seqs", "4", "--no-prefix-caching", "--no-fuse",
                   "--compile", "--dtype", "float32")
    ea = EngineArgs.from_cli_args(given)
    again = EngineArgs.from_cli_args(_parse(*ea.to_cli()))
    assert again == ea


def test_model_choice(tmp_path):
    assert EngineArgs.from_cli_args(_parse()).model_path() is None  # the demo model
    assert EngineArgs.from_cli_args(_parse("--model", str(tmp_path))).model_path() == str(tmp_path)
    with pytest.raises(ConfigError, match="not both"):
        EngineArgs.from_cli_args(_parse("--model", "/x", "--random-model", "tiny")).model_path()


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["bench", "latency"],
                                     ["bench", "throughput"], ["analyze"]])
def test_every_face_takes_the_same_engine_flags(command):
    args = build_parser().parse_args([*command, "--max-num-seqs", "5", "--threads", "2", "--random-model", "tiny"])
    ea = EngineArgs.from_cli_args(args)
    assert ea.overrides == {"max_num_seqs": 5, "num_threads": 2} and ea.random_model == "tiny"
