"""TorchTPU's execution switches: eager mode and matmul precision (held in state.STATE)."""

from __future__ import annotations

from tpu_agent import envvars

from .state import STATE, EagerMode, Precision  # noqa: F401  (torch.tpu's names)


def _initial_mode() -> EagerMode:
    if envvars.DEFER_AND_FUSE.value:
        return EagerMode.DEFER_AND_FUSE
    return EagerMode.DEFER_NEVER


STATE.set_mode(_initial_mode())
# Wait for every executable to finish so its recorded time is execution time, not
# dispatch time (the profiler turns this on for its per-executable table).
STATE.set_time_executables(envvars.TIME_EXECUTABLES.value)


class _Switch:
    """Sets a value now; used as a context manager, restores the old one on exit."""

    def __init__(self, setter, new, old):
        self._setter, self._old = setter, old
        setter(new)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._setter(self._old)
        return False


def get_eager_mode() -> EagerMode:
    return STATE.mode


def set_mode(mode: EagerMode) -> None:
    """Switch for good (a plan's action); leaving fused mode runs what is pending first."""
    STATE.set_mode(mode)


def set_eager_mode(mode: EagerMode) -> _Switch:
    if not isinstance(mode, EagerMode):
        raise TypeError(f"set_eager_mode expects a torch.tpu.EagerMode, got {mode!r}")
    return _Switch(STATE.set_mode, mode, STATE.mode)


def set_time_executables(on: bool) -> None:
    STATE.set_time_executables(on)


def launch_blocking() -> bool:
    return STATE.blocking


class eager_override:
    """Run op by op for a moment without ending the fused graph (no flush)."""

    def __enter__(self):
        self._old = STATE.eager_override
        STATE.set_eager_override(True)

    def __exit__(self, *exc):
        STATE.set_eager_override(self._old)
        return False


def fused() -> bool:
    return STATE.fused


def current_precision() -> Precision:
    return STATE.precision


def set_precision(mode: Precision) -> None:
    """Switch for good (a plan's action)."""
    STATE.set_precision(mode)


def precision(mode: Precision) -> _Switch:
    if not isinstance(mode, Precision):
        raise TypeError(f"precision expects a torch.tpu.Precision, got {mode!r}")
    return _Switch(STATE.set_precision, mode, STATE.precision)


def jax_precision() -> str:
    return STATE.precision.value
