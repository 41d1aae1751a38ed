"""SIGTERM and SIGHUP stop a tune as Ctrl-C does, in every phase: the signal itself (sent to the tune's own
process where the fault is injected, no sleeps) ends the phase, what finished is kept, tune.json and report.md
say 'interrupted', no trial stays RUNNING, and the exit code is 128 + N. In process with a fake runner (the
tune's own flow is what is tested); one real `tpu-agent tune` is stopped in its baseline, its child with it."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import textwrap
from pathlib import Path

import pytest
from rich.console import Console
from support.fake_runner import FakeRunner
from support.fake_tune import TwoGroups, fake_profile
from support.processes import clean_env, run_tool
from tpu_agent import interrupts, pipeline
from tpu_agent.config import TuneOptions
from tpu_agent.measure.runner import interleave

TRIALS = 5



class SignallingRunner(FakeRunner):
    """FakeRunner whose fault is a real signal to this process after the first pair of the n-th measurement."""

    def __init__(self, at, signum):
        super().__init__()
        self.at, self.signum = at, signum

    def _pairs(self, name, base, cand, pairs, report=None):
        self.measured.append((name,))
        if self.at and name.startswith(self.at[0]) and sum(m[0].startswith(self.at[0]) for m in self.measured) \
                == self.at[1]:
            base.step(), cand.step()
            os.kill(os.getpid(), self.signum)  # delivered here: the handler raises in this frame
            raise AssertionError("the signal did not stop the phase")
        return interleave(base.step, cand.step, pairs, report)


def signalled_tune(project: Path, monkeypatch, phase: str, signum: int):
    at = {"search": ("trial", 2), "verification": ("verify", 1), "ablation": ("ablate", 2)}.get(phase)
    runner = SignallingRunner(at, signum)

    def profiled(script, args, run_dir, options, plan=None):
        if (phase == "baseline" and plan is None) or (phase == "profile" and plan is not None):
            os.kill(os.getpid(), signum)
            raise AssertionError("the signal did not stop the phase")
        return fake_profile(script, args, run_dir, options, plan)

    monkeypatch.setattr(interrupts, "_received", None)
    monkeypatch.setattr(pipeline, "Runner", lambda *args, **kwargs: runner)
    monkeypatch.setattr(pipeline, "profile_for_tune", profiled)
    monkeypatch.setattr(pipeline, "make_proposer", lambda *args, **kwargs: TwoGroups())
    options = TuneOptions(trials=TRIALS, seed=0, study="s", storage=f"sqlite:///{project / 's.db'}",
                          output_dir=str(project / "runs"))
    out = io.StringIO()
    result, files = pipeline.tune(project / "train.py", [], options, console=Console(file=out, width=200),
                                  proposer="offline")
    return result, out.getvalue()


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("import torch\nWIDTH = 63\nx = torch.randn(4, WIDTH)\n")
    return tmp_path


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("phase", ["baseline", "search", "verification", "ablation", "profile"])
def test_a_stop_signal_in_each_phase_is_an_interrupt_that_keeps_what_finished(project, monkeypatch, phase, signum):
    before = {s: signal.getsignal(s) for s in interrupts.STOP_SIGNALS}
    result, said = signalled_tune(project, monkeypatch, phase, signum)
    name = signal.Signals(signum).name
    assert result.interrupted and result.interrupted_during == phase and result.interrupted_by == name
    assert f"interrupted during the {phase}" in said and f"by {name}:" in said, said
    saved = json.loads((Path(result.run_dir) / "tune.json").read_text())
    assert saved["interrupted_during"] == phase and saved["interrupted_by"] == name and saved["phase"] == "done"
    assert f"Interrupted during the {phase}" in (Path(result.run_dir) / "report.md").read_text()
    assert interrupts.exit_code() == 128 + signum  # what `tpu-agent tune` exits with: 143, 129
    assert {s: signal.getsignal(s) for s in interrupts.STOP_SIGNALS} == before  # handlers restored
    con = sqlite3.connect(project / "s.db")
    states = [r[0] for r in con.execute("select state from trials")]
    con.close()
    assert "RUNNING" not in states
    assert [t["number"] for t in saved["trials"]] == [t.number for t in result.trials]  # finished trials on disk
    if phase == "baseline":
        assert not result.trials and result.baseline_profile is None
    elif phase == "search":
        assert 0 < len(result.trials) < TRIALS and not result.verdicts
    else:
        assert len(result.trials) == TRIALS
    if phase in ("ablation", "profile"):
        assert result.best is not None and result.best.accepted  # the verified plan stands


STOPS_ITS_TUNE = textwrap.dedent("""
    import os, signal, sys, time
    print("sending the signal", flush=True)
    os.kill(os.getppid(), signal.SIGTERM)  # the tune (this child's parent) is told to stop, mid-baseline
    time.sleep(120)
    print("slept on", flush=True)
""")


def test_sigterm_during_a_real_baseline_stops_its_child_and_exits_143(tmp_path: Path):
    (tmp_path / "stops.py").write_text(STOPS_ITS_TUNE)
    proc = run_tool("tune", "stops.py", "--trials", "2", "--storage", f"sqlite:///{tmp_path / 's.db'}",
                    cwd=tmp_path, env=clean_env(), timeout=100)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "interrupted during the baseline by SIGTERM: nothing was measured yet" in proc.stdout, proc.stdout
    (run_dir,) = [p for p in (tmp_path / ".tpu-agent" / "runs").iterdir() if p.is_dir()]
    log = (run_dir / "baseline-profile.log").read_text()
    assert "sending the signal" in log and "slept on" not in log  # the child was stopped with it
    saved = json.loads((run_dir / "tune.json").read_text())
    assert saved["interrupted_by"] == "SIGTERM" and saved["phase"] == "done"
    assert (run_dir / "report.md").exists()
