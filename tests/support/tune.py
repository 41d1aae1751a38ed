"""Running `tpu-agent tune` as a user would, and interrupting it the way a terminal's Ctrl-C does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from support.paths import TPU_AGENT
from support.processes import clean_env


def start_tool(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The CLI in its own process group, as a terminal runs a job (Ctrl-C reaches the whole group)."""
    return subprocess.Popen([str(TPU_AGENT), *args], cwd=cwd, env=env if env is not None else clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def ctrl_c(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str, str]:
    """SIGINT to the job's whole process group (what Ctrl-C on a terminal does); (exit code, stdout, stderr)."""
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def runs(project: Path) -> list[Path]:
    root = project / ".tpu-agent" / "runs"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def read_or_empty(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def tune_phase(project: Path) -> str | None:
    """The phase the newest tune reports in its tune.json (written whole, by rename), None before it has one."""
    for run_dir in reversed(runs(project)):
        text = read_or_empty(run_dir / "tune.json")
        if text:
            return json.loads(text).get("phase")
    return None
