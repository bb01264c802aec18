"""The command registry: every `strata` command and sub-command, by the module that implements it.

A command is a module with NAME, HELP, `add_arguments(parser)` and `run(args) -> exit code`, and
optionally DESCRIPTION and EPILOG (the text above and below the flags in its --help). COMMANDS
below names each one by its import path, with its HELP (the line `strata --help` lists), so that
building the parser imports no command: argparse looks a command's parser up when it selects it
(to run it, or for its --help), and that lookup imports the module and lets it add its flags. This
is the one place where the CLI is lazy; command modules import what they use at their top.

To add a command: write the module, then add a Command(NAME, HELP, "strata.pkg.module") here (in
a Group for `strata <group> NAME`); tests/test_cli.py checks that NAME and HELP agree.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from strata import cli_options


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # import path of the module with NAME, HELP, add_arguments, run
    log_level: str = "warning"  # default --log-level (a server logs at info, as vLLM's)


@dataclass(frozen=True)
class Group:
    """`strata NAME <command>`: the chosen command is in args.<NAME>_command."""

    name: str
    help: str
    commands: tuple[Command, ...]
    log_level: str = "warning"


COMMANDS: tuple[Command | Group, ...] = (
    Command("generate", "generate text", "strata.cli.generate"),
    Command("serve", "OpenAI-compatible HTTP server", "strata.server.main", log_level="info"),
    Group("bench", "benchmarks (print a table; --json FILE)", (
        Command("throughput", "offline throughput on random-token requests (optionally vs transformers)",
                "strata.bench.throughput"),
        Command("latency", "prefill time, decode tok/s and memory-bandwidth utilisation of one batch "
                "(optionally vs transformers)", "strata.bench.latency"),
        Command("prefix", "TTFT of requests sharing a long system prompt, with and without prefix caching",
                "strata.bench.prefix"),
        Command("preempt", "oversubscribed KV cache: recompute vs swap preemption, outputs checked against a "
                "reference", "strata.bench.preempt"),
        Command("serve", "load-test any OpenAI-compatible server: TTFT, TPOT, ITL, throughput, goodput",
                "strata.bench.serve"),
        Command("train", "training tokens/s, MFU and peak memory: Strata's Trainer vs a plain PyTorch/HF loop",
                "strata.bench.train"),
        Command("structured", "per-token and per-schema cost of structured output (JSON schema); llguidance "
                "vs xgrammar", "strata.bench.structured"),
        Command("lora", "LoRA serving cost: throughput with 0/1/4/16 adapters and batch-1 decode overhead",
                "strata.bench.lora"),
        Command("spec", "speculative decoding (prompt lookup): batch-1 decode speedup and acceptance, "
                "repetitive vs random prompts", "strata.bench.spec"),
        Command("comm", "collectives between local ranks (SHM, gloo, NCCL): nccl-tests table + fitted "
                "alpha-beta model", "strata.bench.comm"),
        Command("plan-accuracy", "strata plan's predictions vs strata bench latency, measured in one run",
                "strata.bench.plan_accuracy"),
    )),
    Command("hw", "this machine: CPU, caches, memory, GPUs, links; measured bandwidth and FLOP/s",
            "strata.cli.hw"),
    Command("plan", "memory, roofline, parallelism and cost of a model on named or this hardware",
            "strata.planner.cli"),
    Command("analyze", "run a workload instrumented; attribute its time; name the bottleneck",
            "strata.analyze.cli"),
    Command("train", "train a model (mixed precision, checkpointing, DDP/FSDP)", "strata.train.cli"),
    Group("deploy", "Kubernetes: the Helm chart's values and manifests sized by the planner", (
        Command("render", "plan GPUs, tensor parallelism and KV cache; write values.yaml + manifests",
                "strata.deploy.cli"),
    )),
)


def build_parser() -> argparse.ArgumentParser:
    """`strata`'s parser: every command listed, none of their modules imported yet."""
    parser = cli_options.StrataParser(prog="strata", description="Strata: an LLM runtime that knows why it is fast "
                                      "or slow")
    cli_options.add_logging_flags(parser, top=True)
    _add_commands(parser, "command", COMMANDS)
    return parser


def command(name: str) -> Command | Group:
    """The top-level entry called `name`."""
    return next(c for c in COMMANDS if c.name == name)


def _add_commands(parser: argparse.ArgumentParser, dest: str, entries) -> None:
    sub = parser.add_subparsers(dest=dest, required=True, action=_LazySubParsers)
    for entry in entries:
        sub.add_parser(entry.name, help=entry.help)
        sub.choices.unfilled[entry.name] = entry


def _fill(parser: argparse.ArgumentParser, entry: Command | Group) -> None:
    """A group's sub-commands, or a command's flags from its module (imported here, once)."""
    if isinstance(entry, Group):
        _add_commands(parser, f"{entry.name}_command", entry.commands)
        return
    mod = importlib.import_module(entry.module)
    parser.description = getattr(mod, "DESCRIPTION", None)
    parser.epilog = getattr(mod, "EPILOG", None)
    mod.add_arguments(parser)
    parser.set_defaults(func=mod.run)
    # `strata generate -v` as well as `strata -v generate`
    cli_options.add_logging_flags(parser, default_level=entry.log_level)


class _Parsers(dict):
    """One level's name -> parser map (argparse's choices); a parser is filled by _fill the first
    time it is looked up: argparse does so for the command it selects, walk_leaves for every one."""

    def __init__(self) -> None:
        super().__init__()
        self.unfilled: dict[str, Command | Group] = {}

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        parser = super().__getitem__(name)
        entry = self.unfilled.pop(name, None)
        if entry is not None:
            _fill(parser, entry)
        return parser

    def get(self, name, default=None):
        return self[name] if name in self else default

    def values(self):
        return [self[name] for name in self]

    def items(self):
        return [(name, self[name]) for name in self]


class _LazySubParsers(argparse._SubParsersAction):
    """argparse's sub-command action over a _Parsers map."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._name_parser_map = self.choices = _Parsers()
