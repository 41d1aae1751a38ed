"""The study storage's SQLite file on a full disk says its cause ("the disk is full"), as every other write of the
tool does: when the storage is opened (exit 2, before any work) and mid-search (at once, not retried as if a
server were unreachable). SQLite keeps no errno: the cause is the folder's, probed, or SQLite's own words."""

from __future__ import annotations

import errno
import os

import optuna
import pytest
import sqlalchemy.exc

from tpu_agent import paths
from tpu_agent.search import storage
from tpu_agent.search.storage import Reconnect, StorageLost, first_line

FULL = "the disk is full (ENOSPC: No space left on device)"


def _sqlite_error(words: str) -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("INSERT INTO trials ...", {}, Exception(words))


@pytest.fixture
def full_disk(monkeypatch):
    """The folder refuses a file as a full disk does (the probe's write raises ENOSPC)."""
    write = paths.Path.write_bytes

    def refuse(self, data):
        if self.name.startswith(".tpu-agent-probe-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return write(self, data)

    monkeypatch.setattr(paths.Path, "write_bytes", refuse)


def test_opening_the_storage_on_a_full_disk_says_the_disk_is_full(tmp_path, full_disk):
    line = first_line(_sqlite_error("disk I/O error"), f"sqlite:///{tmp_path}/studies.db")
    assert line.startswith("OperationalError: ") and line.endswith(f"disk I/O error; {FULL}")
    other = first_line(_sqlite_error("no such table: studies"), f"sqlite:///{tmp_path}/studies.db")
    assert FULL not in other  # not a refusal of the disk: said as it is


def test_sqlite_s_own_words_name_the_disk_when_the_folder_still_takes_a_small_file(tmp_path):
    assert paths.database_refusal(tmp_path / "s.db", _sqlite_error("database or disk is full")) == \
        "the disk is full (SQLite: database or disk is full)"
    assert paths.database_refusal(tmp_path / "s.db", _sqlite_error("disk I/O error")) is None  # no cause known


def test_a_full_disk_mid_search_stops_at_once_with_its_cause(tmp_path, full_disk, monkeypatch):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/studies.db")
    said, slept = [], []
    monkeypatch.setattr(storage.time, "sleep", slept.append)
    with pytest.raises(StorageLost) as caught:
        Reconnect(study, said.append).wait(_sqlite_error("database or disk is full"))
    assert str(caught.value).startswith("cannot write the study storage sqlite:///") and FULL in str(caught.value)
    assert "unreachable" not in str(caught.value) and said == [] and slept == []  # no retrying


def test_any_file_of_ours_the_disk_refused_is_named_with_its_cause(tmp_path):
    """A write no command wrapped (a trial's log, say) still ends in one line naming the file and the cause."""
    import subprocess
    import sys

    code = ("import errno, importlib, os; app = importlib.import_module('tpu_agent.cli.app'); "
            f"app._stdout_refused(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), {str(tmp_path / 'trial-3.log')!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stderr.splitlines() == [f"error: cannot write {tmp_path / 'trial-3.log'}: {FULL}"]
