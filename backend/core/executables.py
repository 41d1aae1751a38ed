"""Every XLA executable the device runs, for the profiler.

An executable is one jit-compiled program: an eager op signature, a fused
graph or a compiled step. The profiler reads, per executable, its optimized
HLO text, XLA's cost analysis (FLOPs, bytes accessed), its memory analysis,
and how often and how long it ran. Analyses are computed on demand from the
abstract arguments kept at compile time, so the hot path pays nothing.

    from tpu_agent.backend.core import executables
    for exe in executables.all():
        exe.name, exe.kind, exe.calls, exe.cost()["flops"], exe.hlo_text()
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import jax

from .jax_setup import device_x64
from .state import STATE

_EXECUTABLES = STATE.executables


def next_id() -> int:
    """The next id of an executable or of a compiled program's graph node (one sequence)."""
    return next(_EXECUTABLES.ids)


def abstract(value):
    """An argument as the compiler sees it (arrays become shape, dtype and sharding)."""
    if isinstance(value, jax.Array) or hasattr(value, "aval_spec"):
        spec = getattr(value, "aval_spec", None)
        if spec is not None:
            return spec
        # An uncommitted array goes wherever the program runs: its placement is not part of it.
        sharding = value.sharding if isinstance(value, jax.Array) and value.committed else None
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return value


@dataclass(eq=False)
class Executable:
    name: str  # "aten.mm.default", "fused_graph_3", "compiled:train_step"
    kind: str  # eager | fused | compiled | view
    fn: Callable  # the jitted function
    args: tuple  # abstract arguments
    source: str | None = None  # the user's file:line that first ran it, where known
    ops: tuple[str, ...] = ()  # the aten ops inside (fused graphs, compiled steps)
    calls: int = 0
    time_s: float = 0.0  # host time of the calls (execution time when blocking)
    raw: Callable | None = None  # the traceable function (graphs: for the VJP of a compiled forward)
    compile_s: float | None = None  # seconds its compile took, where it was timed (fused graphs)
    id: int = field(default_factory=next_id)

    @functools.cached_property
    def compiled(self):
        """Lowered and compiled as the device runs it: inside its 64-bit scope (outside, int64 arguments would
        lower as int32 and the analyses describe another program)."""
        with device_x64():
            return self.fn.lower(*self.args).compile()

    def hlo_text(self) -> str:
        """Optimized HLO, as XLA will run it."""
        return self.compiled.as_text()

    def cost(self) -> dict[str, float]:
        """XLA's cost analysis for one execution: flops, bytes accessed, transcendentals."""
        analysis = self.compiled.cost_analysis()
        if isinstance(analysis, (list, tuple)):
            analysis = analysis[0] if analysis else {}
        analysis = analysis or {}
        return {
            "flops": float(analysis.get("flops", 0.0)),
            "bytes_accessed": float(analysis.get("bytes accessed", 0.0)),
            "transcendentals": float(analysis.get("transcendentals", 0.0)),
        }

    def memory(self) -> dict[str, int]:
        """XLA's memory analysis: argument, output, temporary and peak bytes (per device)."""
        stats = self.compiled.memory_analysis()
        if stats is None:
            return {}
        keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes")
        out = {k.replace("_size_in_bytes", "_bytes"): int(getattr(stats, k, 0) or 0) for k in keys}
        peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
        out["peak_bytes"] = int(peak) or out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
        return out


def register(exe: Executable) -> Executable:
    _EXECUTABLES.registry.append(exe)
    return exe


def all() -> list[Executable]:  # noqa: A001 - reads as executables.all()
    """Every executable compiled in this process, oldest first."""
    return list(_EXECUTABLES.registry)


def reset_counts() -> None:
    """Zero calls and times (say, after warm-up) without forgetting the executables."""
    for exe in _EXECUTABLES.registry:
        exe.calls = 0
        exe.time_s = 0.0


def snapshot() -> dict[int, tuple[int, float]]:
    """Calls and time per executable id, to diff around a measured region."""
    return {exe.id: (exe.calls, exe.time_s) for exe in _EXECUTABLES.registry}


