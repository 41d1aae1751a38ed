"""Compiled steps as one program per step: a step window, opened by the model's forward, closed at the step boundary.

Under compiled steps (auto_compile.py) the model's forward and backward programs and each optimizer's update are
whole programs already; what joins them into one is deferral. When the found model is called with gradients on,
a window opens: the device runs fused (ops recorded, not run) until the step's boundary (the optimizer's step,
`mark_step()`), and the module's programs and the optimizer's update are recorded as single nodes of that graph
(module_program.py, step_program.py) instead of launched. The boundary's flush runs forward + backward + gradient
clipping + update as one XLA program, compiled once per graph structure (lazy.py's key), and the window closes:
the user's own mode is back, and a host read of the loss after the step reads a computed value.

Once a step's program has run from the cache (the same graph as the step before), a step that compiles again says
why, once per reason: new input shapes (named), an optimizer hyperparameter the program holds as a constant
(named), or another graph (a branch taken, a Python number of the forward).

Python's garbage collector: a deep model's step makes thousands of short-lived objects, and every few dozen steps
they trigger a full collection over every object of the process (~1M after importing torch, jax and transformers:
~0.4 s, 10 ms a step on average for a 24-layer GPT-2). After two steps in a row that compiled nothing, the process's
objects are collected once and frozen (`gc.freeze()`), so later full collections walk only what was made since.
The next step that compiles anything (a new shape, a new model) unfreezes them, so a model deleted since can be
collected; `FREEZE_GC = False` (or `torch.tpu.compile_steps(freeze_gc=False)`) leaves the collector alone.

A window that flushed before its boundary (`.item()` of a device value mid-step, a data-dependent shape) ran as
more than one program: the boundary warns once per reason, naming it and its source line.
"""

from __future__ import annotations

import atexit
import gc
import warnings

from ..core import modes, steps
from ..core.lazy import BREAK_REASONS, RECORDER
from ..core.source import user_stacklevel
from ..core.state import STATE, STATS, EagerMode

FREEZE_GC = True  # freeze the process's objects once the step stops compiling (see the module docstring)
STABLE_WINDOWS = 2  # windows in a row that compiled nothing before freezing


class Window:
    """The open step window: the mode it replaced, and the recorder's counts when it opened."""

    def __init__(self) -> None:
        self.saved_mode: EagerMode | None = None  # None: no window open
        self.breaks_at_open = 0
        self.warned: set[str] = set()
        self.split_steps = 0  # windows that ran as more than one program
        self.compiles_at_open = 0
        self.recompiles_at_open = 0
        self.stable = 0  # windows in a row that compiled nothing
        self.frozen = False  # we froze the collector's objects (gc.freeze)
        self.frozen_once = False
        self.recompile_warned: set[str] = set()  # reasons said since the model was found
        self.captures = 0  # captures of a module's forward or an optimizer's update (module_program, step_program)
        self.recapture_reasons: list[str] = []  # why a program of the step captured again (step_program appends)

    def new_model(self) -> None:
        """A model found (compiled steps): its steps have not replayed yet, and its reasons are said anew; what was
        frozen is thawed (a model deleted before this one can be collected)."""
        self.thaw()
        self.stable = 0
        self.recompile_warned.clear()

    @property
    def open(self) -> bool:
        return self.saved_mode is not None

    def begin(self) -> None:
        """Open a window, unless one is open or a step is being captured. In the user's fused mode (the tuner's
        `compile: compiled`) the mode stays; the window still makes the programs nodes of the step's graph."""
        if self.open or RECORDER.capture is not None or steps.suspended():
            return
        self.saved_mode = STATE.mode
        self.breaks_at_open = len(RECORDER.breaks)
        self.compiles_at_open = STATS.compiles + self.captures
        self.recompiles_at_open = len(RECORDER.recompiles)
        self.recapture_reasons.clear()
        modes.set_mode(EagerMode.DEFER_AND_FUSE)

    def end(self, source: str = "step boundary") -> None:
        """Close the window (after the boundary's flush): the user's mode again, and a warning if the step split."""
        if not self.open:
            return
        saved, self.saved_mode = self.saved_mode, None
        modes.set_mode(saved)  # runs anything still pending (nothing, after a boundary)
        self._compiled_again()
        breaks = [b for b in RECORDER.breaks[self.breaks_at_open:] if b.reason in BREAK_REASONS]
        if breaks:
            self.split_steps += 1
            reason = breaks[0].describe()
            if reason not in self.warned:
                self.warned.add(reason)
                warnings.warn(f"tpu compiled steps: a training step ran as {len(breaks) + 1} programs, not one: "
                              f"it needs a concrete value mid-step, {reason}", stacklevel=user_stacklevel())

    def thaw(self) -> None:
        """Unfreeze what we froze (a compile, or compiled steps switched off)."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
            self.stable = 0

    def _compiled_again(self) -> None:
        """After a window: warn when a step that had replayed compiles again (once per reason), and freeze or
        unfreeze the garbage collector's objects."""
        compiled = STATS.compiles + self.captures != self.compiles_at_open  # or captured
        if not compiled:
            self.stable += 1
            if self.stable == STABLE_WINDOWS and FREEZE_GC and not self.frozen:
                gc.collect()  # what is garbage now is freed, not frozen
                gc.freeze()
                if not self.frozen_once:  # thawed at exit: the interpreter's last collection sees everything
                    atexit.register(self.thaw)
                    self.frozen_once = True
                self.frozen = True
            return
        replayed = self.stable >= STABLE_WINDOWS  # the step had stopped compiling
        self.thaw()  # a new shape or model: what was deleted since can be collected again
        self.stable = 0
        recompiles = RECORDER.recompiles[self.recompiles_at_open:]
        if not replayed or not recompiles:
            return
        shapes = sorted({s for r in recompiles for s in r.changed_shapes})
        if self.recapture_reasons:
            reason = "; ".join(dict.fromkeys(self.recapture_reasons))
        elif shapes:
            reason = "new input shapes " + ", ".join(shapes[:4]) + (" ..." if len(shapes) > 4 else "")
        else:
            reason = "another graph with the same input shapes (a branch taken, or a Python number of the forward)"
        if reason not in self.recompile_warned:
            self.recompile_warned.add(reason)
            warnings.warn(f"tpu compiled steps: the step's program compiles again: {reason}",
                          stacklevel=user_stacklevel())


WINDOW = Window()
steps.add_step_listener(WINDOW.end)


def recording() -> bool:
    """True where a compiled-steps program should be a node of the pending graph, not a launch of its own."""
    return WINDOW.open and STATE.fused and RECORDER.capture is None

