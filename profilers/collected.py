"""What a profiling session hands the analysis (build.py): the run as the child described it and what the hooks
gathered (session.py fills them in; build.build_profile reads them after the script)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .schema import Environment, Settings, Step


@dataclass
class Window:
    """Executable calls and transfer counters at a step boundary."""

    calls: dict[int, int]
    stats: tuple[int, int, int, int]
    registered: int  # executables compiled so far
    breaks: int = 0  # fused graph breaks so far


@dataclass
class RunInfo:
    """What the profiler is told of the run, besides what it measures."""

    settings: Settings
    run_dir: Path
    script: str
    args: list[str]
    environment: Callable[[], Environment] | None = None  # the `doctor` probe, recorded in the profile
    rank: int | None = None  # one rank of several (profile --nproc): its own device, no peak calibration


@dataclass
class Collected:
    """What the hooks gathered, for the analysis."""

    steps: list[Step] = field(default_factory=list)
    markers: list[str] = field(default_factory=list)
    whole_run: bool = False
    stopped: bool = False
    window_start: Window | None = None  # at the end of the last warm-up step (None: the script's start)
    window_end: Window | None = None  # at the last step boundary
    region: str | None = None  # the FLOP cross-check region
    region_calls: dict[int, int] | None = None
    counter_flops: float | None = None
    counter_by_op: dict[str, float] = field(default_factory=dict)
    recompile_steps: list[int | None] = field(default_factory=list)  # step of each RECORDER.recompiles entry
    break_steps: list[int | None] = field(default_factory=list)  # step of each RECORDER.breaks entry
    registered_steps: dict[int, int] = field(default_factory=dict)  # executable id -> step it was compiled in
    compile_s: float = 0.0
    compiles: int = 0
    live_peak: int | None = None
    step_peak: int | None = None  # the most bytes alive inside any step (backend/core/memory.py's StepPeak)
    live_end: int | None = None
    device_stats: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    trace_dir: str | None = None
    batches: object = None  # a batches.BatchWatch: every batch the script's loaders yielded
    transfers: object = None  # a shapes.TransferWatch: the lines that copied tensors to the device
    collective_steps: list[dict] = field(default_factory=list)  # per step: (op, ranks) -> (calls, bytes, seconds)
