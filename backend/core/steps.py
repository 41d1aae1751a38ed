"""Step boundaries: `torch.tpu.mark_step()` and listeners (the profiler is one)."""

from __future__ import annotations

from typing import Callable

from .state import STATE

_STEPS = STATE.steps
# id(optimizer) -> elements of the parameters it updates, counted at its first step: what a change to the model's
# widths or vocabulary adds, measured (the profile's `parameters`). A view of the device's state.
trained = _STEPS.trained


def add_step_listener(fn: Callable[[str], None]) -> Callable[[], None]:
    """Call `fn(source)` at every step boundary; returns a function that removes it."""
    _STEPS.listeners.append(fn)
    return lambda: _STEPS.listeners.remove(fn)


def step_boundary(source: str) -> None:
    """End of a training step: run pending fused work, then tell the listeners."""
    import sys

    if _STEPS.suspended:
        return
    lazy = sys.modules.get(__package__ + ".lazy")
    if lazy is not None:
        lazy.RECORDER.flush(source)
    for fn in list(_STEPS.listeners):
        fn(source)


def mark_step() -> None:
    step_boundary("mark_step")


def suspended() -> bool:
    """Inside a compiled step's capture: its step ends when the captured call does."""
    return _STEPS.suspended


class suspend:
    """Inside a captured step the optimizer's hook must not end the step early."""

    def __enter__(self):
        self._old = _STEPS.suspended
        _STEPS.suspended = True

    def __exit__(self, *exc):
        _STEPS.suspended = self._old
        return False


def _optimizer_step_hook(optimizer, args, kwargs) -> None:
    if id(optimizer) not in trained:
        trained[id(optimizer)] = sum({id(p): p.numel() for g in optimizer.param_groups for p in g["params"]}.values())
    step_boundary("optimizer")


def install_optimizer_hook() -> None:
    """Every torch optimizer's step marks a step boundary, with no change to the script."""
    import torch.optim.optimizer as optimizer_module

    if _optimizer_step_hook not in optimizer_module._global_optimizer_post_hooks.values():
        optimizer_module.register_optimizer_step_post_hook(_optimizer_step_hook)
