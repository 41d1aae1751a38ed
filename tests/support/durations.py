"""The order xdist's work-stealing scheduler deals tests in, so that two workers finish together; and every test
measured to take SLOW_S or more is marked `slow`, so that `-m "not slow"` stays a quick pass.

tests/durations.json holds each test's call time from an earlier run when it took KEEP_OVER_S or more
(`bash scripts/test.sh --store-durations` updates the tests it ran); tests missing from it keep their collection order,
after the known ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FILE = Path(__file__).resolve().parents[1] / "durations.json"
KEEP_OVER_S = 2.0  # shorter tests change nothing in the balance
SLOW_S = 6.0  # a test measured this long (or marked by hand) is left out of the quick pass


def load() -> dict[str, float]:
    try:
        return json.loads(FILE.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def mark_slow(items: list[pytest.Item]) -> None:
    """Before `-m "not slow"` deselects by mark: every test measured at SLOW_S or more is slow."""
    known = load()
    for item in items:
        if known.get(item.nodeid, 0.0) >= SLOW_S:
            item.add_marker(pytest.mark.slow)


def longest_first(items: list[pytest.Item], workers: int = 2) -> None:
    """After every reordering of the collection (pytest groups tests by their module-scoped fixtures), before
    xdist reads the order. `--dist worksteal` gives each worker one contiguous share of the list and lets an
    idle worker take the tail of the other's, so the tests are dealt in turn, longest first, into `workers`
    shares laid end to end: each worker starts on its long tests, and what is stolen at the end is short.
    (`--dist load` hands out ever smaller chunks and left one worker alone for the last ~5 minutes of a
    fresh-clone run, 2026-12-02, vmstat: 50 % idle.)"""
    known = load()
    ranked = sorted(items, key=lambda item: -known.get(item.nodeid, 0.0))  # stable: the rest keep their order
    items[:] = [item for share in range(workers) for item in ranked[share::workers]]


class Recorder:
    """Collects each test's call time (on the controller under xdist) and writes the file at the end."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.seen[report.nodeid] = round(report.duration, 1)

    def pytest_sessionfinish(self) -> None:
        # A run of some tests updates theirs and keeps the others' (of test files that still exist).
        root = FILE.parent.parent
        merged = {k: v for k, v in load().items() if k not in self.seen and (root / k.split("::")[0]).exists()}
        merged.update(self.seen)
        slow = {k: v for k, v in sorted(merged.items(), key=lambda kv: -kv[1]) if v >= KEEP_OVER_S}
        FILE.write_text(json.dumps(slow, indent=1) + "\n")
