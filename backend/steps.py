"""Step boundaries: `torch.tpu.mark_step()` and listeners (the profiler is one)."""

from __future__ import annotations

from typing import Callable

_listeners: list[Callable[[str], None]] = []


def add_step_listener(fn: Callable[[str], None]) -> Callable[[], None]:
    """Call `fn(source)` at every step boundary; returns a function that removes it."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn)


def mark_step() -> None:
    for fn in list(_listeners):
        fn("mark_step")
