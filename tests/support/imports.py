"""The import graph of our packages, read from their source, for the layering tests (tests/test_layering.py,
tests/backend/test_backend_layering.py).

Function-level imports count (a lazy import is still a dependence), and so do imports under `if TYPE_CHECKING:` (a
type one module names from another is a dependence too, even where it does not run); a package `__init__` importing
its own children (re-exports) is fine.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path


def modules(roots: dict[str, Path], leave_out: Callable[[str], bool] = lambda name: False) -> dict[str, Path]:
    """Dotted module name -> file, for each package prefix -> directory in `roots`."""
    out = {}
    for prefix, root in roots.items():
        for path in root.rglob("*.py"):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if not leave_out(name):
                out[name] = path
    return out


def imported(path: Path, name: str, known: set[str], ignore: tuple[str, ...] = ()) -> set[str]:
    """The known modules that `name` imports anywhere in its file (the deepest known module of each import);
    imports of a name in `ignore` (or below it) are left out."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if any(target == i or target.startswith(i + ".") for i in ignore):
                continue
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    if path.name == "__init__.py":  # re-exporting its own children is fine
        found = {t for t in found if not t.startswith(name + ".")}
    return found


def graph(found: dict[str, Path], ignore: tuple[str, ...] = ()) -> dict[str, set[str]]:
    known = set(found)
    return {name: imported(path, name, known, ignore) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out
