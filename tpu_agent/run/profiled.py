"""A run under the profiler: the child's environment asks for it, the profile.json it wrote is read back.

`tpu-agent profile` and the tuner's baseline both run their profiles here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tpu_agent import envvars
from tpu_agent.errors import TpuAgentError
from tpu_agent.profilers.schema import Profile, Settings
from tpu_agent.profilers.session import PROFILE_FILE
from tpu_agent.run.launch import RunResult, run_script


def profile_env(settings: Settings, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env[envvars.PROFILE.name] = settings.model_dump_json()
    env["PYTHONUNBUFFERED"] = env.get("PYTHONUNBUFFERED") or "1"
    env.update(extra or {})
    return env


def run_profiled(script: str | Path, args: list[str], settings: Settings, *, runs_root: Path,
                 extra_env: dict[str, str] | None = None, **launch: Any) -> tuple[RunResult, Path]:
    """Run the script under the profiler; (the run, where its profile.json is or would be)."""
    result = run_script(script, args, runs_root=runs_root, env=profile_env(settings, extra_env), **launch)
    return result, Path(result.run_dir) / PROFILE_FILE


def read_profile(path: Path) -> Profile:
    """The profile a run wrote; FileNotFoundError when it wrote none."""
    try:
        return Profile.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValidationError, ValueError) as exc:
        raise TpuAgentError(f"unreadable profile {path}: {exc}") from None
