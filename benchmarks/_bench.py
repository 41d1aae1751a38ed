"""Shared by the benchmark scripts: the header line and interleaved timing.

Not a benchmark itself. Every script prints `header()` first, then times its
variants with `interleaved()`: one call of each variant per round (A B C, A B C,
...), so machine noise hits them alike, or with `in_blocks()`: a block of calls of
each variant per round, for variants that switch between frameworks; figures are
medians over rounds, and a ratio is the median of the per-round ratios (both
variants timed in the same round).
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from typing import Callable


def environment() -> str:
    """The date (UTC), the load average, the commit, the torch and jax versions and the CPU count, without
    importing torch or jax (benchmarks/run_all.py prints it before each benchmark)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{now}  load {load}  commit {commit()}  torch {installed('torch')}  jax {installed('jax')}  "
            f"os.cpu_count() {os.cpu_count()}")


def commit() -> str:
    """The checkout's commit, with `+changes` when tracked files differ from it; `unknown` outside git."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+changes" if changed else "")) if head else "unknown"


def header(what: str) -> str:
    """One line: the date, the load, the commit, torch and jax versions, CPU and torch thread counts, and what
    is measured."""
    import jax
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{now}  load {load}  commit {commit()}  torch {torch.__version__}  jax {jax.__version__}  "
            f"os.cpu_count() {os.cpu_count()}  torch threads {torch.get_num_threads()}  |  {what}")


def interleaved(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one call per variant per round, in rounds."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def in_blocks(variants: dict[str, Callable[[], object]], rounds: int, block: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, a block of `block` calls per variant per round (the order reversed every
    other round). Across frameworks, for steps: switched at every call, XLA's thread pool and PyTorch's fight over
    the cores at each switch and PyTorch's CPU steps looked about 3x slower than they are (issue #28). Each
    block's first call settles the switch and is not timed."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = variants[name]
            fn()
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            times[name].append((time.perf_counter() - t0) / block)
    return times


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of a's time / b's time in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def target(name: str, value: float, op: str, bound: float) -> str:
    """'name 1.23 (<= 1.1, miss)': a ratio with its target beside it."""
    met = {"<=": value <= bound, "<": value < bound, ">=": value >= bound, ">": value > bound}[op]
    return f"{name} {value:.2f} ({op} {bound:g}, {'met' if met else 'MISS'})"


def add_threads_option(parser) -> None:
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads for the CPU reference (default: torch's own). On a loaded "
                             "2-core machine 2 threads can make PyTorch CPU eager tens of times slower than 1")


def apply_threads_option(args) -> None:
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)


class StepsReplays:
    """Replays of compiled steps during the timed rounds, so a silent fall-back to eager would show.
    Made before the variants' warm-up (it notes which programs are new), `start()` after it."""

    def __init__(self) -> None:
        from tpu_agent.backend.compiled import auto_compile

        self.state = auto_compile.STATE
        self.found = len(self.state.modules), len(self.state.optimizers)
        self.before: tuple[list[int], list[int]] = ([], [])

    def start(self) -> None:
        modules, optimizers = self._programs()
        self.before = [m.replays for m in modules], [o.replays for o in optimizers]

    def _programs(self):
        return self.state.modules[self.found[0]:], self.state.optimizers[self.found[1]:]

    def note(self, rounds: int) -> str:
        modules, optimizers = self._programs()
        forward = [m.replays - b for m, b in zip(modules, self.before[0])]
        update = [o.replays - b for o, b in zip(optimizers, self.before[1])]
        reasons = [m.reason_not_compiled for m in modules if m.reason_not_compiled] + \
                  [o.reason_not_replayed for o in optimizers if o.reason_not_replayed]
        return (f"  steps: {len(modules)} module(s) compiled, {forward} forward replays, "
                f"{len(optimizers)} optimizer(s), {update} update replays over {rounds} measured steps"
                + (f"; not compiled: {reasons}" if reasons else ""))


def programs_per_step(step: Callable[[], object], n: int = 3) -> int:
    """XLA programs launched by one step (every executable: ops, fused graphs, compiled programs), the median of
    `n` steps run after the timed rounds (counting inside them would add its own time)."""
    from tpu_agent.backend.core import executables

    counts = []
    for _ in range(n):
        before = sum(e.calls for e in executables.all())
        step()
        counts.append(sum(e.calls for e in executables.all()) - before)
    return sorted(counts)[n // 2]


def programs_line(counts: dict[str, int]) -> str:
    return "  programs per step (launches, median of 3 steps after the timed rounds): " + \
        ", ".join(f"{name} {n}" for name, n in counts.items())
