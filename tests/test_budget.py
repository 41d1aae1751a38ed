"""The suite's time budget: the default pass (`bash scripts/test.sh`, 2 workers) takes at most 20 minutes of pytest
on this 2-core machine, so its recorded durations (tests/durations.json), dealt onto the 2 workers as they run,
must come to 17 minutes (durations.GOAL_S). The pass is not there yet: durations.BUDGET_S holds it where it is, so
a new slow test replaces, merges or shrinks another, or goes to the release matrix (`-m matrix`, docs/ci.md).

Every test of the default pass must have a recorded duration: a test missing from the file would count as
nothing, and a new slow test would pass the budget unseen until the next recording. Record it with
`bash scripts/test.sh --store-durations tests/path/test_file.py` (a run of some tests updates theirs only).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from support import durations
from support.paths import REPO


def _default_pass(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """The default pass's test ids: this session's when it is the default pass (`pytest tests`, no -m, -k or
    file named), else collected in a child process (about 15 s of CPU)."""
    tests = (REPO / "tests").resolve()
    args = {(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args}
    if args == {tests} and not config.option.markexpr and not config.option.keyword and not config.option.deselect:
        return [item.nodeid for item in items]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def test_the_default_pass_fits_its_budget_on_2_workers_by_its_recorded_durations(request):
    ids = _default_pass(request.config, request.session.items)
    assert len(ids) > 100, ids  # the whole pass was read
    known = durations.load()
    missing = [i for i in ids if i not in known]
    recording = request.config.getoption("--store-durations")
    if missing and not recording:  # a --store-durations run records them
        shown = "\n  ".join(missing[:20]) + (f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else "")
        pytest.fail(f"{len(missing)} test(s) of the default pass have no recorded duration in tests/durations.json; "
                    f"run them with `bash scripts/test.sh --store-durations <their files>`:\n  {shown}")
    seconds = [known.get(i, 0.0) for i in ids]
    workers = durations.dealt(seconds)
    longest = sorted(zip(seconds, ids), reverse=True)[:10]
    summary = (f"{len(ids)} tests, {sum(seconds) / 60:.1f} min recorded, dealt onto {durations.WORKERS} workers: "
               + ", ".join(f"{w / 60:.1f}" for w in workers) + f" min (budget {durations.BUDGET_S / 60:.1f}, "
               + f"goal {durations.GOAL_S / 60:.0f}); "
               + "the longest: " + "; ".join(f"{i} {s:.0f} s" for s, i in longest))
    print(summary)
    assert workers[-1] <= durations.BUDGET_S, summary


def test_the_dealing_is_longest_first_onto_the_worker_free_first():
    """The budget's arithmetic: 3, 3, 2, 2, 2 on 2 workers deal as 3 + 2 + 2 and 3 + 2 (longest first, each
    to the worker free first: 7 minutes where 6 + 6 was possible, as the suite's dealing does), the longest test
    alone bounds the pass, and no test is lost."""
    assert durations.dealt([2, 3, 2, 3, 2]) == [5, 7]
    assert durations.dealt([10, 1, 1]) == [2, 10]
    assert sum(durations.dealt([0.5] * 7 + [4.0])) == pytest.approx(7.5)
