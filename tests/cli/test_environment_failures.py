"""One policy for what the environment refuses (issue #27): a read-only folder or a full disk gives one line
naming the path and what was being written, exit 2 before any work and 1 after, the same in run, profile and
tune; no traceback of ours; nothing half-written left behind. Faults are injected (tests/support/faults)."""

from __future__ import annotations

import subprocess

import pytest

from support.paths import EXAMPLES, REPO, TPU_AGENT
from support.processes import clean_env, run_tool

FAULTS = REPO / "tests" / "support" / "faults"
MLP = str(EXAMPLES / "mlp.py")


def _faulty(**faults: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=str(FAULTS), **faults)


def _one_error(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("command", [
    ["run", MLP, "--", "--steps", "2"],
    ["profile", MLP, "--steps", "1"],
    ["tune", MLP, "--trials", "1", "--offline"],
])
def test_a_read_only_folder_is_one_line_and_exit_2_before_any_work(tmp_path, command):
    proc = run_tool(*command, cwd=tmp_path, env=_faulty(FAULT_MKDIR=".tpu-agent"))
    line = _one_error(proc)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert line.startswith("error: cannot write the ") and ".tpu-agent" in line and "Read-only file system" in line
    assert "step=" not in proc.stdout  # the script never ran


@pytest.mark.slow  # the script runs first (about 8 s)
def test_a_full_disk_at_the_end_of_a_run_is_one_line_and_exit_1(tmp_path):
    proc = run_tool("run", MLP, "--", "--steps", "2", cwd=tmp_path, env=_faulty(FAULT_WRITE="run.json"))
    line = _one_error(proc)
    assert proc.returncode == 1 and "cannot write the run record" in line and "No space left on device" in line
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("run.json"))


@pytest.mark.slow  # a profiled run (about 10 s)
def test_a_full_disk_while_the_profile_is_written_is_one_line_and_exit_1(tmp_path):
    proc = run_tool("profile", MLP, "--steps", "1", cwd=tmp_path, env=_faulty(FAULT_WRITE="profile.json"))
    line = _one_error(proc)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "cannot write the profile" in line and "the script ran to its end" in line
    assert "the disk is full (ENOSPC: No space left on device)" in line  # its cause, not only that it was refused
    assert "could not start the run" not in proc.stderr
    assert not list(tmp_path.rglob("profile.json*"))  # nothing half-written looks complete


def test_a_tune_whose_first_record_is_refused_stops_before_any_work(tmp_path):
    proc = run_tool("tune", MLP, "--trials", "1", "--offline", cwd=tmp_path, env=_faulty(FAULT_WRITE="tune.json"))
    line = _one_error(proc)
    assert proc.returncode == 2 and "cannot write the tune's record" in line and "No space left" in line
    assert "baseline" not in proc.stdout


def test_a_corrupted_study_storage_is_one_line_and_exit_2_before_any_work(tmp_path):
    (tmp_path / ".tpu-agent").mkdir()
    (tmp_path / ".tpu-agent" / "studies.db").write_bytes(bytes(range(256)) * 16)  # not a database
    proc = run_tool("tune", MLP, "--trials", "1", "--offline", cwd=tmp_path)
    line = _one_error(proc)
    assert proc.returncode == 2 and "cannot open the study storage" in line and "not a database" in line
    assert "baseline" not in proc.stdout


@pytest.mark.parametrize("command", [
    ["diff", str(REPO / "tests" / "data" / "profile_odd_mlp.json"), str(REPO / "tests" / "data" / "profile_transformer.json")],
    ["knobs", MLP, "--static"],
    ["playbooks"],
])
def test_output_to_a_full_disk_is_one_line_and_exit_1(tmp_path, command):
    with open("/dev/full", "w") as full:  # every write fails: No space left on device
        proc = subprocess.run([str(TPU_AGENT), *command], cwd=tmp_path, env=clean_env(), stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["error: cannot write the output (standard output): the disk is full "
                                        "(ENOSPC: No space left on device)"]
