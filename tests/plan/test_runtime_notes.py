"""What a plan's run-time actions say they did (the notes a trial's record and the console show)."""

from __future__ import annotations

import pytest

from tpu_agent.plan.actions import Compile
from tpu_agent.plan.runtime import Applied


@pytest.mark.parametrize("mode,says,never", [
    ("fused", "fused execution", "compiled"),
    ("compiled", "compiled steps", "fused execution"),
])
def test_a_compile_action_notes_what_it_does(mode, says, never):
    from tpu_agent.backend.core import modes

    before = modes.get_eager_mode()
    applied = Applied()
    try:
        Compile(mode=mode).apply(applied)
    finally:
        modes.set_mode(before)
    (note,) = applied.notes
    assert note.startswith(says) and never not in note
    assert applied.compile_model == (mode == "compiled")
