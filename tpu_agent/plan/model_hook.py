"""A global forward pre-hook that meets the script's models at their first call, for actions that change a
model the script builds (experts implementation, capacity padding), gone once it has done its work."""

from __future__ import annotations

from typing import Callable

import torch


def until_first_model(on_call: Callable[[object], bool]) -> Callable[[], None]:
    """Calls `on_call(module)` before each module's forward until the step boundary after the first call that
    returned True (a model it changed or recognized), or the second boundary at the latest, so measured steps
    pay nothing; returns a function that removes the hook early."""
    from tpu_agent.backend.core import steps

    state = {"models": 0, "boundaries": 0, "removed": False}

    def hook(module, _args):
        state["models"] += bool(on_call(module))
        return None

    def remove() -> None:
        if not state["removed"]:
            state["removed"] = True
            handle.remove()
            stop_listening()

    def on_step(_source: str) -> None:
        state["boundaries"] += 1
        if state["models"] or state["boundaries"] >= 2:
            remove()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    stop_listening = steps.add_step_listener(on_step)
    return remove
