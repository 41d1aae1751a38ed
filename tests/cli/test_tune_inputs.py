"""`tpu-agent tune`: what would fail after the baseline's minutes fails first, one line and exit 2, leaving
no run directory; the tool's own folder is ignored by git."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.processes import clean_env, one_error_line, run_tool

SCRIPT = "import torch\nprint('ran')\n"


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def refused(project: Path, *args: str, env: dict | None = None) -> str:
    proc = run_tool("tune", "train.py", *args, cwd=project, env=clean_env(**(env or {})))
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    runs = project / ".tpu-agent" / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())  # no run directory left behind
    return line


def test_a_missing_playbooks_directory_is_named(project: Path):
    assert refused(project, "--playbooks", "nowhere").startswith("error: --playbooks ")
    assert "nowhere: no such directory" in refused(project, "--playbooks", "nowhere")


def test_a_broken_playbook_is_named_with_the_flag(project: Path):
    (project / "pb").mkdir()
    (project / "pb" / "bad.yaml").write_text("id: [\n")
    line = refused(project, "--playbooks", "pb")
    assert line.startswith("error: --playbooks: ") and "bad.yaml" in line


def test_apply_over_uncommitted_changes_is_refused_before_the_baseline(project: Path):
    git(project, "init", "-q")
    git(project, "add", "train.py")
    git(project, "commit", "-qm", "start")
    (project / "train.py").write_text(SCRIPT + "# edited\n")
    assert refused(project, "--apply") == ("error: --apply: train.py has uncommitted changes; commit them or "
                                           "pass --force")


def test_proposer_claude_without_an_api_key_is_refused(project: Path):
    assert refused(project, "--proposer", "claude") == ("error: --proposer claude needs ANTHROPIC_API_KEY in the "
                                                        "environment (or use --proposer offline)")


def test_a_bad_storage_leaves_no_run_directory(project: Path):
    refused(project, "--storage", "postgresql://nobody@127.0.0.1:1/none")


def test_resume_of_a_missing_study_is_refused(project: Path):
    line = refused(project, "--resume", "--study", "typo")
    assert line.startswith("error: --resume: there is no study 'typo' in sqlite:")


def test_the_tools_folder_is_ignored_by_git(project: Path):
    git(project, "init", "-q")
    run_tool("tune", "train.py", "--resume", "--study", "typo", cwd=project, env=clean_env())
    assert (project / ".tpu-agent" / ".gitignore").read_text().splitlines()[-1] == "*"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True).stdout
    assert ".tpu-agent" not in status and "train.py" in status
