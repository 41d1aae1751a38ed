"""The device's state in one object: its setters keep what the hot path reads in step, and only they write it."""

from __future__ import annotations

import re

import pytest
import torch

from support.paths import REPO
from tpu_agent.backend import mesh, modes, padding
from tpu_agent.backend.lazy import RECORDER
from tpu_agent.backend.state import RNG, STATE, STATS, DeviceState, EagerMode, Precision


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
