"""The device's state in one object: its setters keep what the hot path reads in step, and only they write it."""

from __future__ import annotations

import ast
import re

import pytest
import torch

from support.paths import REPO
from tpu_agent.backend.core import mesh, modes, padding
from tpu_agent.backend.core.lazy import RECORDER
from tpu_agent.backend.core.state import RNG, STATE, STATS, DeviceState, EagerMode, Precision


@pytest.fixture
def fresh():
    return DeviceState()


def test_setters_keep_the_derived_fields_in_step(fresh):
    assert fresh.cache_key_extra == (Precision.DEFAULT, 0, frozenset())
    assert not fresh.fused and not fresh.blocking
    fresh.set_precision(Precision.HIGHEST)
    fresh.set_padding(128, (1001,))
    assert fresh.cache_key_extra == (Precision.HIGHEST, 128, frozenset({1001}))
    fresh.set_mode(EagerMode.DEFER_AND_FUSE)
    assert fresh.fused and not fresh.blocking
    fresh.set_eager_override(True)
    assert not fresh.fused
    fresh.set_eager_override(False)
    fresh.set_mode(EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING)
    assert fresh.blocking and not fresh.fused
    fresh.set_mode(EagerMode.DEFER_NEVER)
    assert not fresh.blocking
    fresh.set_time_executables(True)
    assert fresh.blocking
    fresh.set_time_executables(False)
    fresh.set_mesh(object(), serialize_programs=True)
    assert fresh.blocking
    fresh.set_mesh(None)
    assert not fresh.blocking and fresh.mesh is None
    with pytest.raises(ValueError):
        fresh.set_padding(-1)


def test_module_switches_are_views_of_the_one_object():
    assert STATS is STATE.stats and RNG is STATE.rng and STATE.recorder is RECORDER
    assert modes.EagerMode is EagerMode and torch.tpu.Precision is Precision
    with modes.precision(Precision.HIGH):
        assert STATE.precision is Precision.HIGH and STATE.cache_key_extra[0] is Precision.HIGH
        assert modes.jax_precision() == "high"
    with modes.set_eager_mode(EagerMode.DEFER_AND_FUSE):
        assert modes.fused() and STATE.fused
        with modes.eager_override():
            assert not modes.fused()
        assert modes.fused()
    assert not STATE.fused
    before = padding.key()
    padding.set_multiple(64, (3,))
    try:
        assert STATE.cache_key_extra[1:] == (64, frozenset({3})) == padding.key()
    finally:
        padding.set_multiple(before[0], before[1])
    assert mesh.get_mesh() is STATE.mesh


def test_only_the_setters_write_the_state():
    """An assignment from outside would leave the derived fields stale."""
    fields = set(DeviceState.__slots__)
    pattern = re.compile(r"\bSTATE\.(\w+)\s*(?:=[^=]|\+=|-=)")
    offenders = []
    for root in ("backend", "profilers", "tpu_agent", "tests"):
        for path in (REPO / root).rglob("*.py"):
            if path.name == "state.py" and path.parent.name == "backend":
                continue
            text = path.read_text()
            offenders += [f"{path.relative_to(REPO)}: STATE.{m.group(1)}" for m in pattern.finditer(text)
                          if m.group(1) in fields]
    assert not offenders, offenders


# --- module state: on STATE, not in module globals -------------------------------------------------------------

# Modules whose state lives on STATE (memory peaks and watch, step boundaries, the executables, the distributed
# state): none may keep mutable state
# at module level. A constant table is read-only (a tuple, a frozenset, a MappingProxyType).
STATELESS = ["backend/core/memory.py", "backend/core/mesh.py", "backend/core/sharding.py", "backend/core/steps.py", "backend/core/executables.py",
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "backend" / "distributed").glob("*.py"))]
MUTABLE_CALLS = {"dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "count",
                 "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}
CACHES = {"cache", "lru_cache"}


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _top_level(body):
    """Statements run when the module loads (inside module-level if / try / with too; not in defs or classes)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field_name in ("body", "orelse", "finalbody", "handlers"):
                yield from _top_level(getattr(node, field_name, []))
        elif isinstance(node, ast.ExceptHandler):
            yield from _top_level(node.body)


def module_state(source: str) -> list[str]:
    """Mutable state a module keeps at module level: `global` rebinding, mutable containers, instances of its own
    classes, None slots filled in later, functools caches."""
    tree = ast.parse(source)
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    found = [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = [_name(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            found += [f"line {node.lineno}: @{d} {node.name}" for d in decorators if d in CACHES]
            continue
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        mutable = (isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
                   or (isinstance(value, ast.Constant) and value.value is None)
                   or (isinstance(value, ast.Call) and (_name(value.func) in MUTABLE_CALLS
                                                       or _name(value.func) in classes)))
        if mutable:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.append(f"line {node.lineno}: {', '.join(ast.unparse(t) for t in targets)} = {ast.unparse(value)}")
    return found


@pytest.mark.parametrize("source", [
    "_cache = {}", "_seen: set[str] = set()", "_items = [x for x in ()]", "_ids = itertools.count()",
    "WATCH: object | None = None", "class R:\n    pass\nRECORDED = R()",
    "from functools import cache\n@cache\ndef f(): pass",
    "runs = 0\ndef bump():\n    global runs\n    runs += 1", "if True:\n    _by_key = collections.OrderedDict()",
])
def test_module_state_is_found(source):
    assert module_state(source)


@pytest.mark.parametrize("source", [
    "AXIS = 'ranks'", "OPS = ('sum', 'avg')", "KINDS = frozenset({'a'})", "TABLE = types.MappingProxyType({1: 2})",
    "RECORDED = STATE.distributed.collectives.recording", "_TYPE = re.compile('x')",
    "def f():\n    seen = {}\n    return seen",
])
def test_constants_and_views_of_the_state_are_not_module_state(source):
    assert module_state(source) == []


@pytest.mark.parametrize("path", STATELESS)
def test_the_device_keeps_this_modules_state_on_STATE(path):
    assert module_state((REPO / path).read_text()) == [], f"{path}: keep it on STATE (backend/core/state.py)"


def test_memory_and_distributed_state_live_on_the_one_object(fresh):
    from tpu_agent.backend.core import memory
    from tpu_agent.backend.distributed import collectives

    assert collectives.RECORDED is STATE.distributed.collectives.recording
    assert fresh.distributed.collectives.meshes == {} and fresh.distributed.faults.groups == {}
    assert fresh.distributed.collectives.meshes is not STATE.distributed.collectives.meshes
    assert fresh.memory_watch is None and (fresh.memory_peaks.allocated, fresh.memory_peaks.reserved) == (0, 0)
    assert memory.WATCH is STATE.memory_watch
    with pytest.raises(AttributeError):
        memory.WATCH = object()  # set through STATE.set_memory_watch (memory.watch_step_peaks)

    torch.tpu.reset_peak_memory_stats()
    assert STATE.memory_peaks.allocated == 0
    x = torch.ones(1000, device="tpu") + 1
    stats = torch.tpu.memory_stats()
    assert STATE.memory_peaks.allocated == stats["allocated_bytes.all.peak"] >= 4000
    del x


def test_steps_executables_and_the_recorder_live_on_the_one_object(fresh):
    """A compiled step's capture holds the step boundaries back through steps.suspend (not by writing a module
    global), and what it restores is what was there; the executables and the fused-graph recorder are STATE's."""
    from tpu_agent.backend.core import executables, steps

    assert fresh.steps.listeners == [] and not fresh.steps.suspended and fresh.executables.registry == []
    assert steps.trained is STATE.steps.trained and STATE.recorder is RECORDER
    seen = []
    remove = steps.add_step_listener(seen.append)
    try:
        with steps.suspend():
            assert steps.suspended() and STATE.steps.suspended
            with steps.suspend():
                steps.mark_step()
            assert steps.suspended()
        assert not steps.suspended() and seen == []
        steps.mark_step()
        assert seen == ["mark_step"]
    finally:
        remove()
    assert seen.append not in STATE.steps.listeners
    first, second = executables.next_id(), executables.next_id()
    assert second == first + 1
    before = len(executables.all())
    torch.ones(13, 7, device="tpu").mul(7.5).cpu()  # a shape no other test runs: its mul compiles here
    made = executables.all()[before:]
    assert "aten.mul.Tensor" in [exe.name for exe in made] and executables.all() == STATE.executables.registry
    assert all(exe.id > second for exe in made)  # one sequence of ids
