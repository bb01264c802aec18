"""Strata-internal imports: how many, and which sit inside functions (issue 42 counted them).

    .venv/bin/python scripts/count_imports.py          # totals and per package
    .venv/bin/python scripts/count_imports.py -v       # + file:line of every in-function one
    .venv/bin/python scripts/count_imports.py OTHER/strata   # another checkout's package
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "strata"


def internal(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        return node.level > 0 or mod == "strata" or mod.startswith("strata.")
    if isinstance(node, ast.Import):
        return any(a.name == "strata" or a.name.startswith("strata.") for a in node.names)
    return False


def main(root: Path, verbose: bool) -> None:
    total, inner, by_pkg, rows = 0, 0, collections.Counter(), []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not internal(node):
                continue
            total += 1
            p = parents.get(node)
            while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
                p = parents.get(p)
            if p is not None:
                inner += 1
                by_pkg[f.relative_to(root).parts[0].removesuffix(".py")] += 1
                rows.append(f"{f.relative_to(root.parent)}:{node.lineno}")
    print(f"internal imports {total}, inside functions {inner}")
    print(dict(by_pkg.most_common()))
    if verbose:
        print("\n".join(rows))


if __name__ == "__main__":
    dirs = [Path(a) for a in sys.argv[1:] if a != "-v"]
    main(dirs[0] if dirs else ROOT, "-v" in sys.argv)
