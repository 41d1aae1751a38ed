"""TorchTPU's execution switches: eager mode and matmul precision."""

from __future__ import annotations

import enum
import sys

from tpu_agent import envvars


class EagerMode(enum.Enum):
    DEFER_NEVER = "defer_never"  # op by op, asynchronous (the default)
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "defer_never_and_launch_blocking"  # op by op, each op waited for
    DEFER_AND_FUSE = "defer_and_fuse"  # ops recorded and fused into XLA graphs at sync points


class Precision(enum.Enum):
    DEFAULT = "default"  # on TPUs: f32 matmuls as one bf16 pass
    HIGH = "high"  # three bf16 passes
    HIGHEST = "highest"  # full f32


def _initial_mode() -> EagerMode:
    if envvars.DEFER_AND_FUSE.value:
        return EagerMode.DEFER_AND_FUSE
    return EagerMode.DEFER_NEVER


_mode = _initial_mode()
_precision = Precision.DEFAULT


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
    return _mode


def _set_mode(mode: EagerMode) -> None:
    global _mode
    if _mode is EagerMode.DEFER_AND_FUSE and mode is not EagerMode.DEFER_AND_FUSE:
        recorder = sys.modules.get(__package__ + ".lazy")  # none yet: nothing was recorded
        if recorder is not None:
            recorder.RECORDER.flush("left fused mode")
    _mode = mode


def set_eager_mode(mode: EagerMode) -> _Switch:
    if not isinstance(mode, EagerMode):
        raise TypeError(f"set_eager_mode expects a torch.tpu.EagerMode, got {mode!r}")
    return _Switch(_set_mode, mode, _mode)


# Wait for every executable to finish so its recorded time is execution time, not
# dispatch time (the profiler turns this on for its per-executable table).
time_executables = envvars.TIME_EXECUTABLES.value


# XLA's CPU client deadlocks when two programs with collectives over simulated devices
# are in flight at once; sharding.set_mesh turns this on for such meshes.
serialize_programs = False


def launch_blocking() -> bool:
    return time_executables or serialize_programs or _mode is EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


_eager_override = False


class eager_override:
    """Run op by op for a moment without ending the fused graph (no flush)."""

    def __enter__(self):
        global _eager_override
        self._old, _eager_override = _eager_override, True

    def __exit__(self, *exc):
        global _eager_override
        _eager_override = self._old
        return False


def fused() -> bool:
    return _mode is EagerMode.DEFER_AND_FUSE and not _eager_override


def current_precision() -> Precision:
    return _precision


def _set_precision(mode: Precision) -> None:
    global _precision
    _precision = mode


def precision(mode: Precision) -> _Switch:
    if not isinstance(mode, Precision):
        raise TypeError(f"precision expects a torch.tpu.Precision, got {mode!r}")
    return _Switch(_set_precision, mode, _precision)


def jax_precision() -> str:
    return _precision.value
