"""The command registry (strata/cli/registry.py): every command a module with NAME, HELP,
add_arguments and run; a command's module is imported only when that command is chosen."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from strata.cli import registry


def _commands():
    for entry in registry.COMMANDS:
        yield from (entry.commands if isinstance(entry, registry.Group) else (entry,))


@pytest.mark.parametrize("cmd", list(_commands()), ids=lambda c: c.module)
def test_every_command_module_says_what_the_registry_lists(cmd):
    mod = importlib.import_module(cmd.module)
    assert (mod.NAME, mod.HELP) == (cmd.name, cmd.help)
    assert callable(mod.add_arguments) and callable(mod.run)


def _imported_after(argv: list[str]) -> set[str]:
    code = ("import json, sys\nfrom strata.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_help_imports_no_command_and_no_torch():
    mods = _imported_after(["--help"])
    assert "torch" not in mods
    assert not mods & {c.module for c in _commands()}


def test_a_command_imports_its_own_module_only():
    mods = _imported_after(["bench", "latency", "--help"])
    assert "strata.bench.latency" in mods
    assert not mods & ({c.module for c in _commands()} - {"strata.bench.latency"})
