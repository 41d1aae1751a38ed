"""A run under the profiler: the child's environment asks for it, the profile.json it wrote is read back.

`tpu-agent profile` and the tuner's baseline both run their profiles here.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
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


def gather_ranks(run_dir: Path, nproc: int, exit_code: int) -> None:
    """The ranks' profiles (ranks/rank<R>/profile.json) gathered into the run's profile.json (profile --nproc and
    tune --nproc)."""
    from tpu_agent.paths import CannotWrite, refused, shown_path
    from tpu_agent.profilers.ranks import gather
    from tpu_agent.profilers.schema import write_profile

    merged = gather(run_dir, nproc, exit_code)
    if merged is not None:
        try:
            write_profile(merged, run_dir / PROFILE_FILE)
        except OSError as exc:
            ranks = shown_path(run_dir / "ranks")
            raise CannotWrite(f"{refused(exc, shown_path(run_dir / PROFILE_FILE), 'the profile')} (the ranks' own "
                              f"are in {ranks})") from None


def refused_files(profile: Profile) -> str | None:
    """The one line for the files of a written profile that the environment refused (its HLO files, its plot),
    with the cause (`the disk is full`); None when every file was written."""
    from tpu_agent.paths import refused, shown_path

    if not profile.files.refused:
        return None
    first = profile.files.refused[0]
    return (f"{refused(OSError(first.errno, first.strerror), shown_path(first.path), first.what)}; the profile "
            f"{shown_path(Path(profile.run_dir) / PROFILE_FILE)} holds every figure measured")


def read_profile(path: Path) -> Profile:
    """The profile a run wrote; FileNotFoundError when it wrote none."""
    try:
        return Profile.model_validate_json(Path(path).read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValidationError, ValueError) as exc:
        raise TpuAgentError(f"unreadable profile {path}: {exc}") from None


class StepWatch:
    """A time limit per step for a profiled run, read from the profiler's progress pipe: the run is stopped
    when no step boundary (or the end of its analysis) comes within `step_timeout` seconds of the last one
    (the first one gets up to 120 seconds more, no more than `step_timeout` again: imports, JAX start-up)."""

    def __init__(self, step_timeout: float, startup: float = 120.0) -> None:
        self.step_timeout, self.startup = step_timeout, min(startup, step_timeout)
        self.waiting_for: str | None = None  # what it was waiting for when the limit passed
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, True)
        self.last = time.monotonic()
        self.seen_step = False
        self.timed_out_waiting = "the first step"

    def env(self) -> dict[str, str]:
        return {envvars.PROGRESS_FD.name: str(self.write_fd)}

    def deadline(self) -> float:
        end = self.last + self.step_timeout + (0.0 if self.seen_step else self.startup)
        if self.waiting_for is None and time.monotonic() >= end:
            self.waiting_for = self.timed_out_waiting
        return end

    @contextmanager
    def __call__(self, proc):
        os.close(self.write_fd)
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        try:
            yield
        finally:
            reader.join(timeout=5)

    def _read(self) -> None:
        from pydantic import ValidationError

        from tpu_agent.run.messages import Progress

        with os.fdopen(self.read_fd, "rb") as pipe:
            for raw in pipe:
                try:
                    message = Progress.model_validate_json(raw)
                except ValidationError:
                    continue
                if message.event == "step":
                    self.seen_step, self.last = True, time.monotonic()
                    self.timed_out_waiting = f"step {(message.step or 0) + 1}"
                elif message.event in ("stopping", "analysing"):
                    self.last = time.monotonic()
                    self.timed_out_waiting = "the end of the profile's analysis"
