"""The STRATA_* environment variables are read in one place (strata/settings.py), every one the code
names is listed there, and the README's table lists every one with its default."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from strata.settings import SETTINGS, SWITCHES

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "strata").rglob("*.py"))
NAME = re.compile(r"STRATA_[A-Z0-9_]+")


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every os.environ / os.getenv lookup of a STRATA_* literal or of a module
    constant holding one."""
    consts = {t.id: n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def name_of(arg) -> str | None:
        value = arg.value if isinstance(arg, ast.Constant) else consts.get(getattr(arg, "id", None))
        return value if isinstance(value, str) and value.startswith("STRATA_") else None

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr in ("get", "pop") and is_environ(node.func.value)) or node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and name_of(key):
            found.append((node.lineno, name_of(key)))
    return found


def test_only_settings_reads_strata_variables():
    reads = [f"{p.relative_to(ROOT)}:{line} reads {name}" for p in SOURCES if p.name != "settings.py"
             or p.parent.name != "strata" for line, name in _env_reads(ast.parse(p.read_text()))]
    assert reads == [], "read it through strata.settings.SETTINGS instead"


def test_every_variable_the_code_names_is_listed():
    named = {m for p in SOURCES for m in NAME.findall(p.read_text())}
    named.discard("STRATA_MAX_NUM_SEQS")  # cli_options' docstring example of a flag's variable
    assert named <= {s.name for s in SWITCHES}


def test_the_readme_lists_every_switch_with_its_default():
    readme = (ROOT / "README.md").read_text()
    for s in SWITCHES:
        assert re.search(rf"\| `{s.name}` \| {re.escape(s.default)} \|", readme), s.name


@pytest.mark.parametrize("value, on", [("", True), ("1", True), ("0", False), ("false", False), ("off", False)])
def test_switches_read_live(monkeypatch, value, on):
    monkeypatch.setenv("STRATA_FUSED_DECODE", value)
    assert SETTINGS.fused_decode is on
    monkeypatch.setenv("STRATA_INT8_FP32_ACTIVATIONS", value or "0")
    assert SETTINGS.int8_fp32_activations is (value not in ("", "0"))
