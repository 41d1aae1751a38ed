"""`tune` on a terminal shows a progress bar (trials done of the total, elapsed, an ETA labelled an estimate);
piped, plain trial lines only. In process, with a fake runner and rich's forced-terminal mode."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from support.fake_profiles import make_profile
from support.fake_runner import FakeRunner
from support.fake_tune import Padding
from tpu_agent import pipeline
from tpu_agent.config import TuneOptions

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def profiled(script, args, run_dir, options, plan=None):
    profile = make_profile(script=str(script), step_s=0.010)
    path = Path(run_dir) / ("baseline-profile.json" if plan is None else "plan-profile.json")
    path.write_text(profile.model_dump_json())
    return profile, path


def tune(tmp_path: Path, monkeypatch, console: Console):
    (tmp_path / "train.py").write_text("import torch\n")
    monkeypatch.setattr(pipeline, "Runner", lambda *args, **kwargs: FakeRunner())
    monkeypatch.setattr(pipeline, "profile_for_tune", profiled)
    monkeypatch.setattr(pipeline, "make_proposer", lambda *args, **kwargs: Padding())
    options = TuneOptions(trials=4, seed=0, storage=f"sqlite:///{tmp_path / 's.db'}", output_dir=str(tmp_path / "runs"))
    return pipeline.tune(tmp_path / "train.py", [], options, console=console, proposer="offline")


def test_a_terminal_shows_trials_done_of_total_with_elapsed_and_an_estimated_eta(tmp_path, monkeypatch):
    out = io.StringIO()
    tune(tmp_path, monkeypatch, Console(file=out, force_terminal=True, width=150))
    text = ANSI.sub("", out.getvalue())
    bars = re.findall(r"search .*? (\d)/4 trials (\d+:\d\d:\d\d) elapsed, ETA \(estimate\)", text)
    assert bars, text[-2000:]
    assert [int(done) for done, _ in bars] == sorted(int(done) for done, _ in bars)  # it only moves forward
    assert {int(done) for done, _ in bars} >= {0, 1, 2, 3}  # redrawn under each trial line as trials end
    assert re.search(r"trial +3 ", text)  # the trial lines stay above it


def test_piped_output_has_no_bar_and_full_width_plain_lines(tmp_path, monkeypatch):
    out = io.StringIO()
    tune(tmp_path, monkeypatch, Console(file=out, width=60, soft_wrap=True))  # not a terminal: a pipe, a log
    text = out.getvalue()
    assert "ETA" not in text and "\x1b[" not in text
    line = next(line for line in text.splitlines() if "live: optuna-dashboard" in line)
    assert len(line) > 60  # not wrapped at the console's width
    assert f"optuna-dashboard sqlite:///{tmp_path / 's.db'}" in line  # the storage this tune used

