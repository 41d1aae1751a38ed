"""Compiled steps as one program per step: a step window, opened by the model's forward, closed at the step boundary.

Under compiled steps (auto_compile.py) the model's forward and backward programs and each optimizer's update are
whole programs already; what joins them into one is deferral. When the found model is called with gradients on,
a window opens: the device runs fused (ops recorded, not run) until the step's boundary (the optimizer's step,
`mark_step()`), and the module's programs and the optimizer's update are recorded as single nodes of that graph
(module_program.py, step_program.py) instead of launched. The boundary's flush runs forward + backward + gradient
clipping + update as one XLA program, compiled once per graph structure (lazy.py's key), and the window closes:
the user's own mode is back, and a host read of the loss after the step reads a computed value.

A window that flushed before its boundary (`.item()` of a device value mid-step, a data-dependent shape) ran as
more than one program: the boundary warns once per reason, naming it and its source line.
"""

from __future__ import annotations

import warnings

from . import modes, steps
from .lazy import BREAK_REASONS, RECORDER
from .state import STATE, EagerMode


class Window:
    """The open step window: the mode it replaced, and the recorder's counts when it opened."""

    def __init__(self) -> None:
        self.saved_mode: EagerMode | None = None  # None: no window open
        self.breaks_at_open = 0
        self.warned: set[str] = set()
        self.split_steps = 0  # windows that ran as more than one program

    @property
    def open(self) -> bool:
        return self.saved_mode is not None

    def begin(self) -> None:
        """Open a window, unless one is open or a step is being captured. In the user's fused mode (the tuner's
        `compile: compiled`) the mode stays; the window still makes the programs nodes of the step's graph."""
        if self.open or RECORDER.capture is not None or steps.suspended:
            return
        self.saved_mode = STATE.mode
        self.breaks_at_open = len(RECORDER.breaks)
        modes.set_mode(EagerMode.DEFER_AND_FUSE)

    def end(self, source: str = "step boundary") -> None:
        """Close the window (after the boundary's flush): the user's mode again, and a warning if the step split."""
        if not self.open:
            return
        saved, self.saved_mode = self.saved_mode, None
        modes.set_mode(saved)  # runs anything still pending (nothing, after a boundary)
        breaks = [b for b in RECORDER.breaks[self.breaks_at_open:] if b.reason in BREAK_REASONS]
        if breaks:
            self.split_steps += 1
            reason = breaks[0].describe()
            if reason not in self.warned:
                self.warned.add(reason)
                warnings.warn(f"tpu compiled steps: a training step ran as {len(breaks) + 1} programs, not one: "
                              f"it needs a concrete value mid-step, {reason}", stacklevel=2)


WINDOW = Window()
steps.add_step_listener(WINDOW.end)


def recording() -> bool:
    """True where a compiled-steps program should be a node of the pending graph, not a launch of its own."""
    return WINDOW.open and STATE.fused and RECORDER.capture is None
