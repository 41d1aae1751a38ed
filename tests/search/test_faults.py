"""Fault injection in-process: Ctrl-C in the search, the verification and the ablation loses nothing finished,
and `--resume` repeats nothing. (A trial process killed, hanging or crashing: tests/search/test_tune.py, end to
end; Ctrl-C in the baseline: test_tune_baseline.py.)"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from support.fake_tune import TwoGroups
from support.fake_tune import tune as fake_tune

TRIALS = 5


def tune(project, monkeypatch, interrupt_at=None, resume=False):
    return fake_tune(project, monkeypatch, TwoGroups(), trials=TRIALS, interrupt_at=interrupt_at, resume=resume)



def db_states(project: Path) -> list[str]:
    con = sqlite3.connect(project / "s.db")
    rows = [r[0] for r in con.execute("select state from trials order by number")]
    con.close()
    return rows


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("import torch\nWIDTH = 63\nx = torch.randn(4, WIDTH)\n")
    return tmp_path


@pytest.mark.parametrize("phase,at", [("search", ("trial", 2)), ("verification", ("verify", 1)),
                                      ("ablation", ("ablate", 2)), ("profile", ("profile", 1))])
def test_ctrl_c_in_each_phase_keeps_what_finished_and_resume_repeats_nothing(project, monkeypatch, phase, at):
    first, runner, said = tune(project, monkeypatch, interrupt_at=at)
    assert first.interrupted and first.interrupted_during == phase
    run_dir = Path(first.run_dir)
    saved = json.loads((run_dir / "tune.json").read_text())
    assert saved["interrupted_during"] == phase
    assert f"interrupted during the {phase}" in said.lower()
    report = (run_dir / "report.md").read_text()
    assert f"Interrupted during the {phase}" in report
    assert "RUNNING" not in db_states(project)  # the interrupted trial is closed, not left running

    finished = [t for t in first.trials if t.state in ("complete", "repeated", "failed", "numerics")]
    assert [t["number"] for t in saved["trials"]] == [t.number for t in first.trials]  # every finished trial on disk
    if phase == "search":
        assert len(finished) < TRIALS and not first.verdicts
    else:
        assert len(first.trials) == TRIALS
    if phase == "verification":
        assert first.verdicts == [] and first.best is None
    if phase in ("ablation", "profile"):
        # the verified plan stands, with the part of the ablation that finished
        assert first.best is not None and first.best.accepted and len(first.best.attribution) == (phase == "ablation"
                                                                                                 and 1 or 2)
        assert (run_dir / "plan.json").exists() and first.best.plan.describe() in report
        assert "*Baseline:* the script as written, which ran in fused execution" in report
        assert first.plan_profile is None and first.summary.flops_per_step is None  # its step time only

    second, runner2, said2 = tune(project, monkeypatch, resume=True)
    assert not second.interrupted
    trials_run = [m for m in runner2.measured if m[0].startswith("trial")]
    earlier = [t for t in second.trials if t.earlier]
    assert [t.number for t in earlier] == [t.number for t in first.trials]
    assert len(second.trials) == TRIALS  # the interrupted trial did not count against --trials
    measured_before = {t.plan.key() for t in earlier if t.state == "complete"}
    assert all(t.plan.key() not in measured_before for t in second.trials if not t.earlier and t.state == "complete")
    assert len(trials_run) == len([t for t in second.trials if not t.earlier and t.state == "complete"])
    if phase != "search":
        assert trials_run == []  # the search had finished: nothing measured again
    assert second.best is not None and second.best.accepted  # resume verifies (and ablates) again
    # the verified plan was profiled: report.json's summary has every figure `diff` compares, measured
    summary = json.loads((Path(second.run_dir) / "report.json").read_text())["summary"]
    assert summary["step_time_s"] == 0.0072 and summary["peak_memory_bytes"] == 90 << 20
    assert summary["flops_per_step"] == 2e9 and summary["mfu"] is not None
    assert second.plan_profile and Path(second.plan_profile).name == "plan-profile.json"
    assert "RUNNING" not in db_states(project)
