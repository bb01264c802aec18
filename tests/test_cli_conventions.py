"""vLLM / llama.cpp command-line habits: --config YAML, STRATA_<FLAG> env, flag > env > file >
default, -v after the subcommand, defaults in every help line, "did you mean", one-line errors."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from strata import cli_options
from strata.cli import build_parser, main
from strata.cli_options import env_name, walk_leaves

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_strata_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("STRATA_") and n != "STRATA_CACHE"]:
        monkeypatch.delenv(name)


def run(argv: list[str]) -> int:
    """main()'s exit status; argparse's errors leave through SystemExit as from the shell."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_yaml_env_and_flag_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 8\nmax-num-batched-tokens: 512\nport: 9001\nhost: 0.0.0.0\n"
                   "no_prefix_caching: true\nfuse: false\nserved-model-name: [qwen, qwen-small]\n")
    a = parse("serve", "--config", str(cfg))
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.port, a.host) == (8, 512, 9001, "0.0.0.0")
    assert a.enable_prefix_caching is False and a.fuse is False
    assert a.served_model_name == ["qwen", "qwen-small"]
    monkeypatch.setenv("STRATA_PORT", "9002")
    monkeypatch.setenv("STRATA_MAX_NUM_SEQS", "16")
    monkeypatch.setenv("STRATA_SERVED_MODEL_NAME", "a b")
    a = parse("serve", "--config", str(cfg))
    assert (a.port, a.max_num_seqs, a.max_num_batched_tokens) == (9002, 16, 512)  # env over file
    assert a.served_model_name == ["a", "b"]
    a = parse("serve", "--config", str(cfg), "--port", "9003", "--served-model-name", "c")
    assert (a.port, a.max_num_seqs, a.served_model_name) == (9003, 16, ["c"])  # flag over env
    monkeypatch.delenv("STRATA_PORT")
    monkeypatch.delenv("STRATA_MAX_NUM_SEQS")
    monkeypatch.delenv("STRATA_SERVED_MODEL_NAME")
    a = parse("serve")
    assert (a.port, a.max_num_seqs, a.enable_prefix_caching) == (8000, 128, True)  # defaults untouched


def test_env_reads_every_serve_flag_and_config_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("STRATA_THREADS", "3")
    monkeypatch.setenv("STRATA_DISABLE_LOG_REQUESTS", "yes")
    monkeypatch.setenv("STRATA_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("STRATA_DTYPE", "")  # empty = unset, as shells use it
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_queue: 5\n")
    monkeypatch.setenv("STRATA_CONFIG", str(cfg))
    a = parse("serve")
    assert a.enable_prefix_caching is False and a.num_threads == 3 and a.disable_log_requests
    assert a.log_level == "debug" and a.dtype == "auto" and a.max_queue == 5


def test_env_is_for_serve_only(monkeypatch):
    monkeypatch.setenv("STRATA_MAX_NUM_SEQS", "4")
    assert parse("generate", "--prompt", "x").max_num_seqs == 128


def test_generate_takes_a_config_file_too(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text('max_tokens: 5\nstop: ["\\n", END]\ntemperature: 0.5\nignore_eos: true\nn: 2\n')
    a = parse("generate", "--config", str(cfg), "--prompt", "x", "--temperature", "0")
    assert (a.max_tokens, a.stop, a.temperature, a.ignore_eos, a.n) == (5, ["\n", "END"], 0.0, True, 2)


@pytest.mark.parametrize(("text", "words"), [
    ("max_num_seq: 3\n", "unknown key 'max_num_seq'; did you mean 'max-num-seqs'?"),
    ("port: abc\n", "port: invalid value 'abc'"),
    ("max_num_seqs: 1.5\n", "expected an integer"),
    ("attention_backend: flash\n", "invalid choice 'flash'"),
    ("no_prefix_caching: maybe\n", "expected true or false"),
    ("- port\n", "expected a mapping"),
    ("port: [1, 2]\n", "expected one value"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("port: 1\n  bad: [\n", "not valid YAML"),
])
def test_bad_config_is_one_line_naming_the_key(tmp_path, capsys, text, words):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    assert run(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1 and "usage:" not in err, err


def test_bad_env_value_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_FUSE", "maybe")
    assert run(["serve"]) == 2
    assert "STRATA_FUSE: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_missing_config_file(capsys, tmp_path):
    assert run(["serve", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "suggestion"), [
    (["serve", "--prot", "1"], "unrecognized argument --prot; did you mean --port?"),
    (["generate", "--temprature", "0.5"], "did you mean --temperature?"),
    (["serve", "--max-num-sesq=4"], "did you mean --max-num-seqs?"),
    (["bench", "latency", "--input-lenn", "4"], "did you mean --input-len?"),
])
def test_mistyped_flag_suggests_the_close_one(capsys, argv, suggestion):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert suggestion in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["generate", "-v"], ["-v", "generate"], ["generate", "--log-level", "info"]])
def test_verbose_after_the_subcommand(argv):
    a = parse(*argv, "--prompt", "x")
    assert cli_options.log_level(a) == "info"


def test_log_level_defaults():
    assert cli_options.log_level(parse("generate", "--prompt", "x")) == "warning"
    assert cli_options.log_level(parse("serve"), default="info") == "info"
    assert cli_options.log_level(parse("--log-level", "error", "serve"), default="info") == "error"
    assert parse("serve", "--log-level", "ERROR").log_level == "error"


def test_every_flag_of_every_command_has_help_and_a_default_shown():
    """`strata X --help` for every (sub)command: each option line says what it does and its default."""
    parser = build_parser()
    missing = []
    for leaf in [parser, *walk_leaves(parser)]:
        fmt = leaf._get_formatter()
        for action in leaf._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = fmt._expand_help(action) if action.help else ""
            if not text.strip() or "default" not in text:
                missing.append(f"{leaf.prog} {action.option_strings[-1]}: {text!r}")
    assert not missing, "\n".join(missing)


def test_help_renders_for_every_command(capsys):
    parser = build_parser()
    for leaf in walk_leaves(parser):
        leaf.format_help()  # a '%' in a help text or default would raise here
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--port PORT TCP port" in out and "(default: 8000)" in out and "--config FILE.yaml" in out


def test_env_names_do_not_collide_with_internal_variables():
    """STRATA_<FLAG> of every serve flag vs the STRATA_* variables the code reads for itself: the only
    overlap is STRATA_API_KEY, which has always meant --api-key."""
    internal = set()
    for path in (REPO / "strata").rglob("*.py"):
        if path.name == "cli_options.py":  # its docstrings show the naming rule
            continue
        internal |= set(re.findall(r"\bSTRATA_[A-Z0-9_]+\b", path.read_text()))
    serve = next(leaf for leaf in walk_leaves(build_parser()) if leaf.prog == "strata serve")
    flags = {env_name("STRATA_", o) for o in serve.long_options() if o not in ("--help",)}
    assert internal & flags == {"STRATA_API_KEY"}, internal & flags
