"""A file of a profile that the disk could not hold (an HLO file, the step-time plot) says its cause, "the disk is
full", in one line; the profile and its figures, measured before the refusal, stand. Faults are injected at the
write (tests/support/faults)."""

from __future__ import annotations

import errno
import json
import os
import pathlib

from support.paths import DATA, EXAMPLES, REPO
from support.processes import clean_env, run_tool
from tpu_agent.profilers import build, ranks
from tpu_agent.profilers.schema import Profile, Refused
from tpu_agent.run.profiled import refused_files

FAULTS = REPO / "tests" / "support" / "faults"


def _full_disk(monkeypatch, suffix: str) -> None:
    write = pathlib.Path.write_text

    def refuse(self, *args, **kwargs):
        if self.name.endswith(suffix):
            write(self, "half")  # what a full disk leaves: a part of the file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", refuse)


def test_an_hlo_file_refused_is_recorded_with_its_errno_and_leaves_no_half_file(tmp_path, monkeypatch):
    _full_disk(monkeypatch, ".hlo.txt")
    refused: list[Refused] = []
    assert build._write_hlo(tmp_path / "0000-dot.hlo.txt", "HloModule m", refused) is None
    assert [(r.what, r.errno) for r in refused] == [("the HLO files", errno.ENOSPC)]
    assert list(tmp_path.iterdir()) == []
    kept = build._write_hlo(tmp_path / "0001-add.txt", "HloModule a", refused)  # another name: written
    assert kept is not None and pathlib.Path(kept).read_text() == "HloModule a"


def test_the_line_for_a_refused_file_says_the_disk_is_full_and_where_the_profile_is():
    profile = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    assert refused_files(profile) is None
    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    profile.files.refused = [Refused.of(exc, "/x/hlo/0000-dot.hlo.txt", "the HLO files")]
    line = refused_files(profile)
    assert line.startswith("cannot write the HLO files /x/hlo/0000-dot.hlo.txt: the disk is full (ENOSPC: ")
    assert line.endswith("profile.json holds every figure measured")


def test_the_ranks_refusals_reach_the_gathered_profile(tmp_path):
    base = Profile.model_validate_json((DATA / "profile_odd_mlp.json").read_text())
    for rank in (0, 1):
        prof = base.model_copy(deep=True)
        if rank == 1:
            prof.files.refused = [Refused(what="the HLO files", path="r1/hlo/a.hlo.txt", errno=errno.ENOSPC)]
        (ranks.rank_dir(tmp_path, rank)).mkdir(parents=True)
        (ranks.rank_dir(tmp_path, rank) / "profile.json").write_text(prof.model_dump_json())
    merged = ranks.gather(tmp_path, 2, 0)
    assert [r.path for r in merged.files.refused] == ["r1/hlo/a.hlo.txt"]


def test_profile_with_its_hlo_files_and_plot_refused_shows_the_profile_then_one_line_exit_1(tmp_path):
    env = clean_env(PYTHONPATH=str(FAULTS), FAULT_WRITE=".hlo.txt", FAULT_OPEN="step_times.png")
    proc = run_tool("profile", str(EXAMPLES / "mlp.py"), "--steps", "1", "--warmup", "1", cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert errors[0].startswith("error: cannot write the HLO files ") and ".hlo.txt: the disk is full (ENOSPC" in errors[0]
    assert "FLOPs/step" in proc.stdout  # the figures measured before the refusal, shown
    (run_dir,) = (tmp_path / ".tpu-agent" / "runs").iterdir()
    prof = json.loads((run_dir / "profile.json").read_text())
    assert [r["what"] for r in prof["files"]["refused"]] == ["the HLO files", "the step-time plot"]
    assert prof["files"]["plot"] is None and prof["files"]["hlo_dir"] is None and prof["steps"]["items"]
    assert not (run_dir / "hlo").exists() and not list(run_dir.glob("*step_times*"))
