"""tpu_agent's packages import one another in one direction (ORDER); its modules (and the profiler's) import one
another without a circle; the profiler stays below the application; every TPU_AGENT_* variable is declared in
tpu_agent.envvars and read only through it (the device's and the profiler's modules included).

Function-level imports count (a lazy import is still a dependence), and so do imports under `if TYPE_CHECKING:` (a
type named from another module is a dependence on it); a package `__init__` importing its own children (re-exports)
is fine.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

from support import imports
from support.paths import REPO

ROOTS = {"tpu_agent": REPO / "tpu_agent", "tpu_agent.profilers": REPO / "profilers"}
APPLICATION = ("tpu_agent.cli", "tpu_agent.run", "tpu_agent.plan", "tpu_agent.propose", "tpu_agent.measure",
               "tpu_agent.search", "tpu_agent.verify", "tpu_agent.report", "tpu_agent.pipeline", "tpu_agent.config",
               "tpu_agent.paths", "tpu_agent.errors", "tpu_agent.interrupts", "tpu_agent.slices",
               "tpu_agent.parallelism", "tpu_agent.projection")  # not tpu_agent.envvars: the settings' declarations sit below the profiler too

# tpu_agent's packages and top-level modules (and the device, the profiler and the playbooks installed under it),
# highest first: each imports only entries after it. One entry per package: what a package's modules import of one
# another is the circle test's business.
ORDER = [
    "tpu_agent.__main__",  # `python -m tpu_agent`
    "tpu_agent.cli",  # one module per command
    "tpu_agent.pipeline",  # `tune`, phase by phase
    "tpu_agent.report",  # what the tune found, as text and JSON
    "tpu_agent.parallelism",  # the tune's parallelism step: reads the search's trials, measures through measure/
    "tpu_agent.verify",  # verify and search are siblings (test_search_and_verify_are_siblings)
    "tpu_agent.search",
    "tpu_agent.propose",
    "tpu_agent.measure",
    "tpu_agent.run",  # child processes: runs, profiles, trials, projections
    "tpu_agent.plan",
    "tpu_agent.projection",  # the engine: record, lower, partition, cost, rank plans for a slice
    "tpu_agent.config",
    "tpu_agent.slices",  # the slice table (names, chips, torus), read by config and the projection
    "tpu_agent.paths",
    "tpu_agent.errors",
    "tpu_agent.interrupts",
    "tpu_agent.profilers",
    "tpu_agent.backend",
    "tpu_agent.playbooks",
    "tpu_agent.envvars",
    "tpu_agent.partner_gone",
    "tpu_agent",  # the package itself: __version__
]
EVERYTHING = {**ROOTS, "tpu_agent.backend": REPO / "backend", "tpu_agent.playbooks": REPO / "playbooks"}


def _entry(module: str) -> str:
    """The ORDER entry a module belongs to: its package under tpu_agent, or the top-level module itself."""
    return ".".join(module.split(".")[:2])


def _modules() -> dict[str, Path]:
    # the device has its own layering test (tests/backend/test_backend_layering.py)
    return imports.modules(ROOTS, leave_out=lambda name: name.startswith("tpu_agent.backend"))


def _graph() -> dict[str, set[str]]:
    # the device (its own layering test) and the playbook data
    return imports.graph(_modules(), ignore=("tpu_agent.backend", "tpu_agent.playbooks"))


_cycles = imports.cycles


def test_no_import_circle():
    graph = _graph()
    assert sum(map(len, graph.values())) > 100  # the graph was read
    assert _cycles(graph) == []


def test_every_package_and_top_level_module_has_its_place_in_the_order():
    entries = {_entry(m) for m in imports.modules(EVERYTHING)}
    assert entries - set(ORDER) == set(), "add to ORDER (and docs/layout.md)"
    assert set(ORDER) - entries == set(), "gone: drop from ORDER"


def test_packages_import_only_the_ones_below_them():
    graph = imports.graph(imports.modules(EVERYTHING))
    assert "tpu_agent.projection.record" in graph["tpu_agent.plan.parallelism"]  # function-level, read
    assert "tpu_agent.search.records" in graph["tpu_agent.parallelism.measured"]  # under TYPE_CHECKING, read
    place = {entry: i for i, entry in enumerate(ORDER)}
    upward = sorted(f"{m} -> {t}" for m, deps in graph.items() for t in deps if place[_entry(t)] < place[_entry(m)])
    assert upward == []


def test_the_profiler_does_not_import_the_application():
    graph = _graph()
    wrong = {m: sorted(t for t in deps if t.startswith(APPLICATION) or t == "tpu_agent")
             for m, deps in graph.items() if m.startswith("tpu_agent.profilers")}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_search_and_verify_are_siblings():
    """Both measure through tpu_agent.measure; neither imports the other, in either direction."""
    graph = _graph()
    crossing = {m: sorted(t for t in deps if t == other or t.startswith(other + "."))
                for m, deps in graph.items()
                for own, other in (("tpu_agent.search", "tpu_agent.verify"), ("tpu_agent.verify", "tpu_agent.search"))
                if m == own or m.startswith(own + ".")}
    assert {"tpu_agent.search.study", "tpu_agent.verify.verdict"} <= set(crossing)  # both were read
    assert {m: d for m, d in crossing.items() if d} == {}


def test_every_module_is_under_500_lines_and_few_sit_at_the_top():
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: k for n, k in lines.items() if k > 500} == {}
    top = [p for p in (REPO / "tpu_agent").glob("*.py")]
    assert len(top) <= 10, sorted(p.name for p in top)  # 10: slices, the slice table beside config


def test_every_tpu_agent_variable_is_declared_once():
    from tpu_agent import envvars

    used = set()
    for folder in ("tpu_agent", "profilers", "backend"):
        for path in (REPO / folder).rglob("*.py"):
            used |= set(re.findall(r"\bTPU_AGENT_[A-Z_]*[A-Z]\b", path.read_text()))
    assert used <= envvars.NAMES, sorted(used - envvars.NAMES)
    assert len({v.name for v in envvars.ALL}) == len(envvars.ALL)


# ---------------------------------------------------------------- settings are read through their declarations

DECLARATIONS = REPO / "tpu_agent" / "envvars.py"
_TPU_AGENT_NAME = "TPU_AGENT_?"  # `os.environ.get(envvars.X.name)`: a declared variable read past its getter


def _environ_reads(source: str) -> list[str]:
    """The TPU_AGENT_* names `source` reads from the process environment directly: `os.environ[...]` (not a
    write), `os.environ.get/pop/setdefault(...)`, `os.getenv(...)`, `... in os.environ`; the name given as a
    literal, as a module-level constant holding one, or as a declaration's `.name`."""
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}

    def environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", None) == "os"
                or isinstance(node, ast.Name) and node.id == "environ")

    def named(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.Name):
            text = constants.get(node.id, "")
        elif (isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute)
              and getattr(node.value.value, "id", None) == "envvars"):
            text = _TPU_AGENT_NAME
        else:
            return None
        return text if text.startswith("TPU_AGENT_") else None

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and environ(func.value)
                    or isinstance(func, ast.Attribute) and func.attr == "getenv" and getattr(func.value, "id", None) == "os"
                    or isinstance(func, ast.Name) and func.id == "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(environ(c) for c in node.comparators):
            keys.append(node.left)
    return [name for name in map(named, keys) if name]


def test_the_reader_finds_direct_reads():
    source = """
import os
from os import environ, getenv
ENV = "TPU_AGENT_COMPILE_STEPS"
a = os.environ.get("TPU_AGENT_PAD_OPS", "")
b = os.environ[ENV]
c = os.getenv("TPU_AGENT_DEVICES") or getenv("TPU_AGENT_DEVICE")
d = "TPU_AGENT_PLAN" in os.environ or environ.pop("TPU_AGENT_TRIAL", None)
e = os.environ.get(envvars.DEVICES.name)
os.environ["TPU_AGENT_DEVICES"] = "2"
f = os.environ.get("XLA_FLAGS", "") + dict(os.environ).get("HOME", "")
"""
    assert sorted(_environ_reads(source)) == sorted([
        "TPU_AGENT_PAD_OPS", "TPU_AGENT_COMPILE_STEPS", "TPU_AGENT_DEVICES", "TPU_AGENT_DEVICE", "TPU_AGENT_PLAN",
        "TPU_AGENT_TRIAL", _TPU_AGENT_NAME])


def test_no_module_reads_a_tpu_agent_variable_past_its_declaration():
    """The device and the profiler included: `envvars.PAD_OPS.get()`, `envvars.DEVICES.value`, never
    `os.environ.get("TPU_AGENT_PAD_OPS")`."""
    found = {}
    paths = [p for folder in ("tpu_agent", "profilers", "backend") for p in (REPO / folder).rglob("*.py")]
    assert len(paths) > 100
    for path in paths:
        if path != DECLARATIONS:
            reads = _environ_reads(path.read_text())
            if reads:
                found[str(path.relative_to(REPO))] = reads
    assert found == {}


def test_the_declarations_sit_below_everything():
    """envvars imports the standard library only, so the device and the profiler can read their settings there;
    with partner_gone (the words a rank and the tool share when a rank's partner died), the only modules of the
    tool they import. Both import the standard library only."""
    import sys

    for bottom in (DECLARATIONS, REPO / "tpu_agent" / "partner_gone.py"):
        tree = ast.parse(bottom.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"} == set()
    below = {"tpu_agent.backend", "tpu_agent.profilers", "tpu_agent.playbooks", "tpu_agent.envvars",
             "tpu_agent.partner_gone"}
    wrong = {}
    for folder, package in (("backend", "tpu_agent.backend"), ("profilers", "tpu_agent.profilers")):
        for path in (REPO / folder).rglob("*.py"):
            here = ".".join([package, *path.relative_to(REPO / folder).parent.parts])
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if base == "tpu_agent" else base for a in node.names]
                else:
                    continue
                for target in targets:
                    if (target == "tpu_agent" or target.startswith("tpu_agent.")) and not any(
                            target == b or target.startswith(b + ".") for b in below):
                        wrong.setdefault(str(path.relative_to(REPO)), []).append(target)
    assert wrong == {}


def test_every_package_is_in_the_wheel():
    """pyproject lists the packages by name: one left out installs in editable mode and is missing from a wheel."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([package, *p.parent.relative_to(REPO / folder).parts])
             for package, folder in setuptools["package-dir"].items() for p in (REPO / folder).rglob("__init__.py")}
    assert len(found) > 10 and found - set(setuptools["packages"]) == set()


def test_every_test_file_has_a_name_of_its_own():
    """pytest imports test files by their basename (rootdir mode, no packages): two of one name fail collection
    ('import file mismatch'), which a run of either alone never shows."""
    names = Counter(p.name for p in (REPO / "tests").rglob("test_*.py"))
    assert not [name for name, n in names.items() if n > 1]
