"""Warm-up and memory as TorchTPU reports its own benchmarks (issue #28 point 5).

TorchTPU warms up until the compile-cache-miss count stops changing, then reports the steady step time,
the first step's time, the warm-up overhead and peak memory. The profiler's `--warmup K` is a fixed count
chosen before the run; this reads where compiling actually stopped, from the steps' own `compiled` flags.
"""

from __future__ import annotations

from statistics import median

from .schema import Memory, Step, Steps, WarmUp

FLAT_BYTES = 1024  # a steady step may keep this much more (a counter, an allocator's rounding) and still be flat
FLAT_SHARE = 0.001


def summarize(steps: Steps, memory: Memory) -> WarmUp | None:
    """None when the run had no step (a whole-run region has nothing to warm up)."""
    items = steps.items
    if not items or steps.whole_run:
        return None
    compiling = max((st.index for st in items if st.compiled), default=0)
    warm = [st for st in items if st.index <= compiling]
    steady = [st for st in items if st.index > compiling and not st.instrumented]
    warmup_s = sum(st.wall_s for st in warm)
    steady_s = median(st.wall_s for st in steady) if steady else None
    overhead = warmup_s - len(warm) * steady_s if steady_s is not None else None
    runtime_peak = memory.device_stats.get("peak_bytes_in_use")
    peak, source = ((runtime_peak, "the runtime's peak_bytes_in_use") if runtime_peak
                    else (memory.step_peak_bytes, "in-step peak") if memory.step_peak_bytes
                    else (memory.live_peak_bytes, "live buffers at a step boundary") if memory.live_peak_bytes
                    else (None, None))
    slope = _slope(steady)
    flat = None
    if slope is not None:
        first = next(st.live_bytes for st in steady if st.live_bytes is not None)
        flat = slope <= max(FLAT_BYTES, FLAT_SHARE * first)
    return WarmUp(first_step_s=items[0].wall_s, first_step_instrumented=items[0].instrumented,
                  compiling_steps=compiling, warmup_s=warmup_s, overhead_s=overhead,
                  steady_step_s=steady_s, steady_steps=len(steady), programs_compiled=steps.compiles,
                  peak_bytes=peak, peak_source=source, live_growth_bytes_per_step=slope, memory_flat=flat)


def _slope(steps: list[Step]) -> float | None:
    """Bytes per step by which the floor of live memory rises: the least of the last third of the steady steps
    against the least of the first third. A leak raises the floor; garbage the cycle collector frees every few
    steps (a sawtooth, FSDP2's fused steps) and one step that frees late do not."""
    points = [(st.index, st.live_bytes) for st in steps if st.live_bytes is not None]
    if len(points) < 3:
        return None
    k = max(1, len(points) // 3)
    first, last = points[:k], points[-k:]
    span = sum(x for x, _ in last) / k - sum(x for x, _ in first) / k
    return (min(y for _, y in last) - min(y for _, y in first)) / span if span else None
