"""Directory rules and the runner's result, in-process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tpu_agent import paths
from tpu_agent.errors import InputError
from tpu_agent.cli.inputs import check_script
from tpu_agent.run.launch import RESULT_FILE, RunResult, run_script


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TPU_AGENT_CACHE_DIR", raising=False)
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "tpu-agent"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "tpu-agent"
    monkeypatch.setenv("TPU_AGENT_CACHE_DIR", str(tmp_path / "mine"))
    assert paths.cache_dir() == tmp_path / "mine"


def test_run_dirs_never_collide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(paths.time, "strftime", lambda fmt: "20250101-120000")
    made = [paths.new_run_dir(Path("my train!.py"), tmp_path) for _ in range(3)]
    assert [p.name for p in made] == [
        "20250101-120000-my_train_",
        "20250101-120000-my_train_-2",
        "20250101-120000-my_train_-3",
    ]
    assert all(p.is_dir() for p in made)


def test_check_script_rejects_null_bytes_and_honours_coding(tmp_path: Path) -> None:
    bad = tmp_path / "nul.py"
    bad.write_bytes(b"x = 1\x00\n")
    with pytest.raises(InputError) as info:
        check_script(bad)
    assert info.value.exit_code == 2
    latin = tmp_path / "latin.py"
    latin.write_bytes("# -*- coding: latin-1 -*-\ns = 'caf\xe9'\n".encode("latin-1"))
    assert check_script(latin) == latin


def test_run_script_records_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    monkeypatch.chdir(tmp_path)
    result = run_script(script, ["5"], runs_root=tmp_path / "runs")
    assert result.exit_code == 5 and result.signal_number is None
    assert result.command[:4] == [sys.executable, "-P", "-m", "tpu_agent.run.child"]
    assert Path(result.run_dir).parent == tmp_path / "runs"
    saved = RunResult.model_validate_json((Path(result.run_dir) / RESULT_FILE).read_text())
    assert saved == result


def test_run_script_reports_death_by_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.chdir(tmp_path)
    result = run_script(script, runs_root=tmp_path / "runs")
    assert result.signal_number == 9
    assert result.exit_code == 128 + 9
