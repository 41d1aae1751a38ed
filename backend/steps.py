"""Step boundaries: `torch.tpu.mark_step()` and listeners (the profiler is one)."""

from __future__ import annotations

from typing import Callable

_listeners: list[Callable[[str], None]] = []
suspended = False  # inside a compiled step's capture: the step ends when the call does


def add_step_listener(fn: Callable[[str], None]) -> Callable[[], None]:
    """Call `fn(source)` at every step boundary; returns a function that removes it."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn)


def step_boundary(source: str) -> None:
    """End of a training step: run pending fused work, then tell the listeners."""
    import sys

    if suspended:
        return
    lazy = sys.modules.get(__package__ + ".lazy")
    if lazy is not None:
        lazy.RECORDER.flush(source)
    for fn in list(_listeners):
        fn(source)


def mark_step() -> None:
    step_boundary("mark_step")


# id(optimizer) -> elements of the parameters it updates, counted at its first step: what a change to the model's
# widths or vocabulary adds, measured (the profile's `parameters`).
trained: dict[int, int] = {}


def _optimizer_step_hook(optimizer, args, kwargs) -> None:
    if id(optimizer) not in trained:
        trained[id(optimizer)] = sum({id(p): p.numel() for g in optimizer.param_groups for p in g["params"]}.values())
    step_boundary("optimizer")


def install_optimizer_hook() -> None:
    """Every torch optimizer's step marks a step boundary, with no change to the script."""
    import torch.optim.optimizer as optimizer_module

    if _optimizer_step_hook not in optimizer_module._global_optimizer_post_hooks.values():
        optimizer_module.register_optimizer_step_post_hook(_optimizer_step_hook)
