"""The backend's modules depend in one direction (the order docs/layout.md gives), distributed/'s included."""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "backend"
PACKAGES = ("core", "aten", "compiled", "nn", "integration", "distributed", "ops")  # ops/ is one unit, the others' modules each one

# Each module may import (at module level) only modules earlier in this list: core/ (state, arrays, the deferred
# graph) at the bottom, then distributed/, the lowerings (ops/), aten/ (one op's route), compiled/, nn/ and
# integration/ (the device in PyTorch). distributed/'s modules sit where
# their imports put them: the process group and the collectives below the op lowerings that call them (ops/),
# the in-program collectives above fused mode's recorder, the functional collectives' handlers above execute.
ORDER = [
    "core.__init__", "aten.__init__", "compiled.__init__", "nn.__init__", "integration.__init__",
    "core.jax_setup", "core.dtypes", "core.state", "core.source", "core.registry", "core.executables",
    "core.generations", "core.modes", "core.padding", "core.mesh", "core.memory", "core.launch", "core.lazy",
    "core.programs", "core.views", "core.tensor", "core.transfer", "core.steps", "core.sharding", "distributed.__init__", "distributed.faults",
    "distributed.topology", "distributed.runtime", "distributed.group_mesh", "distributed.collectives",
    "distributed.process_group", "distributed.in_program", "distributed.tensor_ops", "distributed.exchange", "ops",
    "aten.opinfo", "aten.arguments", "aten.fallback", "aten.execute", "distributed.functional", "aten.writes",
    "aten.view_ops", "aten.handlers", "aten.dispatch", "compiled.capture",
    "compiled.whole_step", "compiled.step_program", "compiled.module_program", "compiled.optimizer_program",
    "compiled.compile", "compiled.auto_compile", "integration.pinned", "integration.autocast", "nn.attention",
    "nn.recurrent", "nn.transformer", "integration.checkpoints", "nn.lazy_modules", "integration.module",
    "integration.device", "integration.autoload", "__init__",
]


def _unit(parts: list[str]) -> str:
    """The ORDER entry of a module path under backend/ (["distributed", "faults"]: distributed/faults.py)."""
    if parts[0] == "ops":
        return "ops"
    if parts[0] in PACKAGES:
        return f"{parts[0]}.{parts[1]}" if len(parts) > 1 else f"{parts[0]}.__init__"
    return parts[0]


def _me(path: Path) -> str:
    package = path.parent.relative_to(BACKEND).parts
    return _unit([*package, path.stem])


def _imports(path: Path) -> set[str]:
    """Backend modules imported at module level (function-level imports are lazy loading)."""
    package = list(path.parent.relative_to(BACKEND).parts)
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.ImportFrom) and node.level >= 1):
            continue
        up = node.level - 1
        if up > len(package):
            continue  # above backend/
        base = package[:len(package) - up]
        if node.module:
            target = base + node.module.split(".")
            if (BACKEND.joinpath(*target)).is_dir():  # `from .distributed import x`: its modules
                found.update(_unit(target + [alias.name]) for alias in node.names)
            else:
                found.add(_unit(target))
        else:  # `from . import x`, `from .. import x`
            found.update(_unit(base + [alias.name]) for alias in node.names)
    return found


def _paths() -> list[Path]:
    return list(BACKEND.glob("*.py")) + [p for package in PACKAGES for p in (BACKEND / package).glob("*.py")]


def test_every_backend_module_is_placed():
    modules = {_me(p) for p in _paths()}
    assert modules <= set(ORDER), f"add to ORDER (and docs/layout.md): {sorted(modules - set(ORDER))}"
    assert "distributed.collectives" in modules and "distributed.functional" in modules


def test_the_imports_are_read():
    assert _imports(BACKEND / "integration" / "device.py") >= {"distributed.process_group", "core.steps"}
    assert _imports(BACKEND / "ops" / "collectives.py") >= {"distributed.collectives", "distributed.process_group"}
    assert _imports(BACKEND / "distributed" / "in_program.py") >= {"core.lazy", "core.state", "distributed.collectives",
                                                                 "distributed.group_mesh"}


def test_backend_imports_go_one_way():
    rank = {name: i for i, name in enumerate(ORDER)}
    problems = []
    for path in _paths():
        me = _me(path)
        for target in _imports(path):
            if target != me and target in rank and rank[target] >= rank[me]:
                problems.append(f"{path.relative_to(BACKEND)} imports {target}")
    assert not problems, problems
