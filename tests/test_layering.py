"""tpu_agent's modules (and the profiler's) import one another without a circle; the profiler stays below the
application; every TPU_AGENT_* variable is declared in tpu_agent.envvars.

Function-level imports count (a lazy import is still a dependence); imports under `if TYPE_CHECKING:` do not
run and do not count; a package `__init__` importing its own children (re-exports) is fine.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.paths import REPO

ROOTS = {"tpu_agent": REPO / "tpu_agent", "tpu_agent.profilers": REPO / "profilers"}
APPLICATION = ("tpu_agent.cli", "tpu_agent.run", "tpu_agent.plan", "tpu_agent.propose", "tpu_agent.search",
               "tpu_agent.verify", "tpu_agent.report", "tpu_agent.pipeline", "tpu_agent.config", "tpu_agent.paths",
               "tpu_agent.envvars", "tpu_agent.errors")


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name.startswith("tpu_agent.backend") or "backend" in rel.parts[:1]:
                continue
            out[name] = path
    return out


def _imported(path: Path, name: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if target == "tpu_agent.backend" or target.startswith(("tpu_agent.backend.", "tpu_agent.playbooks")):
                continue  # the device (its own layering test) and the playbook data
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    if path.name == "__init__.py":  # re-exporting its own children is fine
        found = {t for t in found if not t.startswith(name + ".")}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imported(path, name, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_import_circle():
    graph = _graph()
    assert sum(map(len, graph.values())) > 100  # the graph was read
    assert _cycles(graph) == []


def test_the_profiler_does_not_import_the_application():
    graph = _graph()
    wrong = {m: sorted(t for t in deps if t.startswith(APPLICATION) or t == "tpu_agent")
             for m, deps in graph.items() if m.startswith("tpu_agent.profilers")}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_every_module_is_under_600_lines_and_few_sit_at_the_top():
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: k for n, k in lines.items() if k > 600} == {}
    top = [p for p in (REPO / "tpu_agent").glob("*.py")]
    assert len(top) <= 8, sorted(p.name for p in top)


def test_every_tpu_agent_variable_is_declared_once():
    from tpu_agent import envvars

    used = set()
    for folder in ("tpu_agent", "profilers", "backend"):
        for path in (REPO / folder).rglob("*.py"):
            used |= set(re.findall(r"\bTPU_AGENT_[A-Z_]*[A-Z]\b", path.read_text()))
    assert used <= envvars.NAMES, sorted(used - envvars.NAMES)
    assert len({v.name for v in envvars.ALL}) == len(envvars.ALL)
