"""A report the disk could not hold says its cause and where what was measured is kept (tune.json, the study)."""

from __future__ import annotations

import errno
import os
import pathlib

import pytest

from support.paths import DATA
from tpu_agent.config import TuneOptions
from tpu_agent.paths import CannotWrite
from tpu_agent.profilers.schema import Profile
from tpu_agent.report.markdown import write_all
from tpu_agent.report.result import TuneResult, measured_on, summary_of


def test_a_report_md_refused_by_a_full_disk_says_so_and_where_the_verdicts_are(tmp_path, monkeypatch):
    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    result = TuneResult(script=str(tmp_path / "train.py"), args=[], settings=TuneOptions(), study="train-1",
                        storage="-", run_dir=str(tmp_path), summary=summary_of(profile, None),
                        host=measured_on(profile))
    write = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if self.name.startswith(".report.md"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(CannotWrite) as caught:
        write_all(result, tmp_path / "train.py")
    said = str(caught.value)
    assert said.startswith(f"cannot write the report {tmp_path / 'report.md'}: the disk is full (ENOSPC: ")
    assert said.endswith(f"every trial and verdict measured is kept in {tmp_path / 'tune.json'} and study 'train-1'")
    assert (tmp_path / "report.json").exists() and not list(tmp_path.glob("*report.md*"))
