"""A tune killed outright (SIGKILL) leaves no trial RUNNING once the study is opened again, and `--resume` runs
the killed trial again, once; tunes started together in one fresh folder each finish with their own study (their
SQLite storage's tables are created under a lock). Real processes: the tune's flow with a fake runner."""

from __future__ import annotations

import io
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
from rich.console import Console
from support.fake_runner import FakeRunner
from support.fake_tune import Padding, fake_profile
from support.paths import REPO
from support.tune import wait_for
from tpu_agent import pipeline
from tpu_agent.config import TuneOptions

TRIALS = 4


def tune(project: Path, monkeypatch, runner, resume: bool):
    monkeypatch.setattr(pipeline, "Runner", lambda *args, **kwargs: runner)
    monkeypatch.setattr(pipeline, "profile_for_tune", fake_profile)
    monkeypatch.setattr(pipeline, "make_proposer", lambda *args, **kwargs: Padding((8, 16, 32, 64, 128)))
    options = TuneOptions(trials=TRIALS, seed=0, study="s", resume=resume, verify=0,
                          storage=f"sqlite:///{project / 's.db'}", output_dir=str(project / "runs"))
    result, _ = pipeline.tune(project / "train.py", [], options, console=Console(file=io.StringIO()),
                              proposer="offline")
    return result


# The same tune in a process of its own, whose second trial hangs after writing `hung`: it is then SIGKILLed.
HANGS_IN_ITS_SECOND_TRIAL = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    import pytest
    sys.path[:0] = [{tests!r}, {here!r}]
    from support.fake_runner import FakeRunner
    import test_killed_and_concurrent as t

    class Hangs(FakeRunner):
        def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
            if name.startswith("trial") and sum(m[0].startswith("trial") for m in self.measured) == 1:
                Path("hung").write_text(name)
                threading.Event().wait()  # until SIGKILL
            return super().measure(plan, name, pairs, report, fresh_baseline)

    t.tune(Path.cwd(), pytest.MonkeyPatch(), Hangs(), resume=False)
""")


def states(project: Path) -> list[str]:
    con = sqlite3.connect(project / "s.db")
    rows = [r[0] for r in con.execute("select state from trials order by number")]
    con.close()
    return rows


def test_a_trial_left_running_by_sigkill_is_failed_on_open_and_resume_runs_it_again_once(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("import torch\n")
    (tmp_path / "hangs.py").write_text(HANGS_IN_ITS_SECOND_TRIAL.format(tests=str(REPO / "tests"),
                                                                       here=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, "hangs.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: (tmp_path / "hung").exists() or proc.poll() is not None, 60, "the second trial")
        assert proc.poll() is None, proc.communicate()[0]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert states(tmp_path) == ["COMPLETE", "RUNNING"]  # what a hard kill leaves
    killed = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}").trials[1]
    assert killed.user_attrs["process"]["pid"] == proc.pid

    runner = FakeRunner()
    result = tune(tmp_path, monkeypatch, runner, resume=True)
    assert "RUNNING" not in states(tmp_path)
    trials = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's.db'}").trials
    assert trials[1].state == optuna.trial.TrialState.FAIL  # failed on open: its process was gone
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == 1]  # RetryHeartbeatStaleTrialCallback's mark
    assert len(retries) == 1 and retries[0].params == killed.params  # run again, once
    assert retries[0].state == optuna.trial.TrialState.COMPLETE
    assert [t.number for t in result.trials if t.earlier] == [0] and len(result.trials) == TRIALS
    assert runner.measured[0][0] == f"trial-{retries[0].number}"  # the retry comes first


OPENS_AND_SEARCHES = textwrap.dedent("""
    import sys
    from pathlib import Path
    import optuna
    from tpu_agent.config import TuneOptions
    from tpu_agent.search.study import open_study
    sys.stdin.read(1)  # started together: all wait here for one byte
    name = sys.argv[1]
    study = open_study(TuneOptions(storage="sqlite:///" + str(Path("runs").resolve().parent / "studies.db")),
                       name, "fp-" + name, Path("runs"))
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=3)
    print(name, len(study.trials))
""")


def test_four_tunes_started_together_in_a_fresh_folder_each_get_their_own_study(tmp_path):
    (tmp_path / "opens.py").write_text(OPENS_AND_SEARCHES)
    names = ["a", "b", "c", "d"]
    procs = [subprocess.Popen([sys.executable, "opens.py", name], cwd=tmp_path, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names]
    for p in procs:  # imports done or not, each opens the storage the moment it reads its byte
        p.stdin.write("g")
        p.stdin.flush()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-800:] for _, err in outs]
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    assert sorted(optuna.study.get_all_study_names(storage=storage)) == names
    for name in names:
        trials = optuna.load_study(study_name=name, storage=storage).trials
        assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
