"""README's "Coming from vLLM / llama.cpp": every `strata` line in it parses as written (with its
environment variables applied), means what its vLLM / llama.cpp twin means, and the flags the
section calls "not here" are refused rather than ignored."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from strata.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _section_commands() -> list[str]:
    text = README.read_text()
    block = text.split("<!-- vllm-llamacpp-commands -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


COMMANDS = _section_commands()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("STRATA_") and n != "STRATA_CACHE"]:
        monkeypatch.delenv(name)
    (tmp_path / "serve.yaml").write_text("max-num-seqs: 64\nmax_model_len: 4096\n")  # as the section shows
    (tmp_path / "tmpl.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.chdir(tmp_path)


def _parse(line: str, monkeypatch):
    words = shlex.split(line)
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    assert words[0] == "strata", line
    return build_parser().parse_args(words[1:])


def test_the_section_lists_both_ecosystems():
    assert len(COMMANDS) >= 12
    assert any(c.startswith("strata generate") for c in COMMANDS) and any("bench serve" in c for c in COMMANDS)


@pytest.mark.parametrize("line", COMMANDS)
def test_every_command_parses_as_written(line, monkeypatch):
    args = _parse(line, monkeypatch)
    assert callable(args.func)


def test_the_mappings_mean_what_they_say(monkeypatch):
    by_start = {c.split(" --")[0] + " " + c.split()[-1]: c for c in COMMANDS}
    env = next(c for c in COMMANDS if c.startswith("STRATA_PORT"))
    a = _parse(env, monkeypatch)
    assert (a.port, a.max_model_len) == (8080, 4096)
    llama_server = next(c for c in COMMANDS if "--port 8080" in c and "--max-num-seqs 4" in c)
    a = _parse(llama_server, monkeypatch)
    assert (a.host, a.max_model_len, a.max_num_seqs, a.max_num_batched_tokens, a.num_threads) == (
        "0.0.0.0", 4096, 4, 2048, 8)
    aliases = next(c for c in COMMANDS if "--served-model-name" in c)
    assert _parse(aliases, monkeypatch).served_model_name == ["qwen", "qwen-small"]
    tp = next(c for c in COMMANDS if "--tensor-parallel-size 2" in c)
    a = _parse(tp, monkeypatch)
    assert a.enable_prefix_caching is False and a.disable_log_requests and a.swap_space == "4GiB"
    assert by_start  # the lines are distinct commands
    cfg = next(c for c in COMMANDS if "--config serve.yaml" in c)
    assert (_parse(cfg, monkeypatch).max_num_seqs, _parse(cfg, monkeypatch).max_model_len) == (64, 4096)


@pytest.mark.parametrize("flag", ["--enforce-eager", "--cpu-offload-gb", "--mlock", "-ngl"])
def test_flags_called_not_here_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, "1"])
    assert e.value.code == 2 and "unrecognized" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["fp8_e5m2", "float16", "int4"])
def test_kv_cache_dtypes_not_here_are_refused(value, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--kv-cache-dtype", value])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
