"""What the tune's baseline says when it cannot go on, told from the profile the run wrote: a script that ran no op
on tpu is called so first (a step or not), one that used the device but took no training step says how many of
its ops reached it, and a profile whose HLO files the disk could not hold stops the tune with the cause."""

from __future__ import annotations

import errno
from datetime import datetime, timezone
from pathlib import Path

import pytest

from support.paths import DATA
from tpu_agent.config import TuneOptions
from tpu_agent.paths import CannotWrite
from tpu_agent.profilers.schema import Profile, Refused
from tpu_agent.run import tune_profile
from tpu_agent.run.launch import RunResult
from tpu_agent.run.tune_profile import BaselineFailed, profile_for_tune


def _baseline(tmp_path: Path, monkeypatch, *, steps: bool, device_ops: int, refused: bool = False):
    """profile_for_tune on a run that wrote `profile` (the child process replaced by its result)."""
    prof = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    prof.device_ops = device_ops
    if device_ops == 0:  # nothing reached the device: no copy, no program
        prof.transfers.h2d_count, prof.executables, prof.flops = 0, [], None
    prof.steps.whole_run = not steps
    if refused:
        prof.files.refused = [Refused(what="the HLO files", path=str(tmp_path / "hlo" / "0000-dot.hlo.txt"),
                                      errno=errno.ENOSPC, strerror="No space left on device")]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    prof.run_dir = str(run_dir)
    (run_dir / "profile.json").write_text(prof.model_dump_json())

    def ran(script, args, settings, *, runs_root, **launch):
        if launch.get("monitor") is not None:
            import os

            os.close(launch["monitor"].write_fd)
        return RunResult(script=str(script), args=[], cwd=str(tmp_path), command=[], run_dir=str(run_dir),
                         started_at=datetime.now(timezone.utc), duration_s=1.0, exit_code=0), run_dir / "profile.json"

    monkeypatch.setattr(tune_profile, "run_profiled", ran)
    return lambda: profile_for_tune(tmp_path / "noisy.py", [], tmp_path, TuneOptions())


def test_a_script_that_ran_nothing_on_tpu_and_took_no_step_is_called_one_that_ran_nothing(tmp_path, monkeypatch):
    with pytest.raises(BaselineFailed) as caught:
        _baseline(tmp_path, monkeypatch, steps=False, device_ops=0)()
    assert str(caught.value).startswith("no op of noisy.py ran on the tpu device, so there are no device figures "
                                        "to tune"), caught.value


def test_a_script_that_used_the_device_without_a_step_says_so_with_its_ops(tmp_path, monkeypatch):
    with pytest.raises(BaselineFailed) as caught:
        _baseline(tmp_path, monkeypatch, steps=False, device_ops=3)()
    said = str(caught.value)
    assert said.startswith("no training step was seen in noisy.py (3 op(s) of it reached the tpu device, none "
                           "inside a step)"), said
    assert "ran on the tpu device" not in said


def test_a_baseline_whose_hlo_files_were_refused_stops_the_tune_with_the_cause(tmp_path, monkeypatch):
    with pytest.raises(CannotWrite) as caught:
        _baseline(tmp_path, monkeypatch, steps=True, device_ops=10, refused=True)()
    said = str(caught.value)
    assert said.startswith("cannot write the HLO files ") and "the disk is full (ENOSPC: No space left" in said
    assert caught.value.exit_code == 1


def test_a_baseline_on_the_device_with_steps_goes_on(tmp_path, monkeypatch):
    profile, path = _baseline(tmp_path, monkeypatch, steps=True, device_ops=10)()
    assert profile.device_ops == 10 and path.name == "profile.json"


def test_a_baseline_log_the_disk_cannot_hold_says_the_disk_is_full(tmp_path, monkeypatch):
    import builtins
    import os

    opened = builtins.open

    def full(file, mode="r", *args, **kwargs):
        if str(file).endswith("baseline-profile.log"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return opened(file, mode, *args, **kwargs)

    run = _baseline(tmp_path, monkeypatch, steps=True, device_ops=10)
    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(CannotWrite) as caught:
        run()
    said = str(caught.value)
    assert said.startswith("cannot write the baseline's log ") and said.endswith(
        "baseline-profile.log: the disk is full (ENOSPC: No space left on device)"), said
