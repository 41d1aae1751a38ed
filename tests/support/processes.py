"""Running the installed `tpu-agent` and python in subprocesses, as a user would, and checking their errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import TPU_AGENT


def clean_env(**overrides: str) -> dict[str, str]:
    """The test's environment without settings that would change what we check."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"ANTHROPIC_API_KEY", "TPU_AGENT_CACHE_DIR", "TPU_AGENT_RUN_DIR", "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    }
    env.update(overrides)
    return env


def run_tool(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    if not TPU_AGENT.exists():
        pytest.fail(f"{TPU_AGENT} is missing: install the package (bash scripts/setup.sh) and run pytest with its python")
    return subprocess.run(
        [str(TPU_AGENT), *args],
        cwd=cwd,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """Assert the process failed with exactly one `error:` line on stderr and nothing on stdout."""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{proc.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert proc.stdout == "", proc.stdout
    return lines[0]
