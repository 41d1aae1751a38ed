"""The backend's modules depend in one direction (the order docs/layout.md gives)."""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "backend"

# Each module may import (at module level) only modules earlier in this list.
ORDER = [
    "jax_setup", "dtypes", "state", "source", "registry", "executables", "generations", "modes", "padding",
    "mesh", "memory", "launch", "lazy", "programs", "views", "tensor", "transfer", "ops",
    "opinfo", "arguments", "fallback", "execute", "writes", "view_ops", "handlers", "dispatch",
    "steps", "sharding", "capture", "whole_step", "step_program", "module_program", "optimizer_program", "compile",
    "auto_compile", "pinned", "autocast", "attention", "recurrent", "transformer", "checkpoints", "lazy_modules", "module",
    "device",
    "autoload", "__init__",
]


def _imports(path: Path) -> set[str]:
    """Backend modules imported at module level (function-level imports are lazy loading)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            depth = node.level - (1 if path.parent.name == "ops" else 0)
            if depth != 1:
                if path.parent.name == "ops" and node.level == 1:
                    continue  # ops importing ops
                continue
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_every_backend_module_is_placed():
    modules = {p.stem for p in BACKEND.glob("*.py")} | {"ops"}
    assert modules <= set(ORDER), f"add to ORDER (and docs/layout.md): {sorted(modules - set(ORDER))}"


def test_backend_imports_go_one_way():
    rank = {name: i for i, name in enumerate(ORDER)}
    problems = []
    paths = list(BACKEND.glob("*.py")) + list((BACKEND / "ops").glob("*.py"))
    for path in paths:
        me = "ops" if path.parent.name == "ops" else path.stem
        for target in _imports(path):
            if target in rank and rank[target] >= rank[me]:
                problems.append(f"{path.relative_to(BACKEND)} imports {target}")
    assert not problems, problems
