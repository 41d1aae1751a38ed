"""`tpu-agent profile`: check the inputs, run the script under the profiler, show the profile.

The measuring happens in the child (`tpu_agent.profilers.session`); this side
validates options before anything starts, shows progress while the script
runs (on a terminal) and renders the `profile.json` the child wrote.
"""

from __future__ import annotations

import codecs
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tpu_agent.errors import InputError, TpuAgentError
from tpu_agent.cli.inputs import check_script
from tpu_agent.paths import RUNS_SUBDIR
from tpu_agent.profilers.schema import Profile, Settings
from tpu_agent.profilers.session import PROFILE_ENV, PROFILE_FILE, PROGRESS_FD_ENV


def writable_dir(path: Path, what: str) -> Path:
    """Create `path` if needed and prove it takes a file; InputError (exit 2) if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".tpu-agent-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"cannot write to the {what} {path}: {exc.strerror or exc}") from None
    return path


def _relay(source, sink) -> threading.Thread:
    """Copy a child's pipe to our stream as it comes (rich shows it above the progress bar)."""

    def pump() -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        fd = source.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            sink.write(decoder.decode(chunk))
            sink.flush()
        tail = decoder.decode(b"", final=True)
        if tail:
            sink.write(tail)
        source.close()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


class ProgressDisplay:
    """A progress bar on stderr fed by the child's progress pipe; the script's output relayed above it."""

    def __init__(self, console: Console, script: str, total: int | None) -> None:
        self.console = console
        self.script = script
        self.total = total
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, True)

    def env(self) -> dict[str, str]:
        return {PROGRESS_FD_ENV: str(self.write_fd)}

    @contextmanager
    def __call__(self, proc: subprocess.Popen):
        os.close(self.write_fd)
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console, transient=True,
                            redirect_stdout=True, redirect_stderr=True)
        task = progress.add_task(f"profiling {self.script}: starting", total=self.total)
        with progress:
            relays = [_relay(proc.stdout, sys.stdout), _relay(proc.stderr, sys.stderr)]
            reader = threading.Thread(target=self._read, args=(progress, task), daemon=True)
            reader.start()
            try:
                yield
            finally:
                for thread in (*relays, reader):
                    thread.join(timeout=5)

    def _read(self, progress: Progress, task) -> None:
        with os.fdopen(self.read_fd, "rb") as pipe:
            for raw in pipe:
                parts = raw.decode(errors="replace").split()
                if not parts:
                    continue
                if parts[0] == "step" and len(parts) >= 3:
                    step, wall = int(parts[1]), float(parts[2])
                    progress.update(task, completed=step,
                                    description=f"profiling {self.script}: step {step}, last {wall * 1e3:.3g} ms")
                elif parts[0] == "analysing":
                    progress.update(task, description=f"profiling {self.script}: analysing executables")


def profile(
    script: str,
    script_args: list[str],
    *,
    settings: Settings,
    output_dir: Path | None,
    json_output: bool,
    stdout: Console,
    stderr: Console,
) -> int:
    from tpu_agent.run.launch import run_script

    check_script(script)
    if settings.trace_dir:
        settings.trace_dir = str(writable_dir(Path(settings.trace_dir).resolve(), "trace directory"))
    runs_root = writable_dir(output_dir if output_dir is not None else Path.cwd() / RUNS_SUBDIR, "output directory")

    env = dict(os.environ)
    env[PROFILE_ENV] = settings.model_dump_json()
    env["PYTHONUNBUFFERED"] = env.get("PYTHONUNBUFFERED") or "1"
    display = None
    if stderr.is_terminal and not json_output:
        total = settings.warmup + settings.steps if settings.steps is not None else None
        display = ProgressDisplay(stderr, Path(script).name, total)
        env.update(display.env())
    try:
        result = run_script(
            script, script_args, runs_root=runs_root, env=env,
            # --json: stdout carries the profile; the script's own output goes to stderr.
            stdout=subprocess.PIPE if display else (sys.stderr.fileno() if json_output else None),
            stderr=subprocess.PIPE if display else None,
            pass_fds=(display.write_fd,) if display else (),
            monitor=display,
        )
    except OSError as exc:
        raise TpuAgentError(f"could not start the run: {exc}") from None

    path = Path(result.run_dir) / PROFILE_FILE
    try:
        prof = Profile.model_validate_json(path.read_text())
    except FileNotFoundError:
        why = f"killed by signal {result.signal_number}" if result.signal_number else f"exit {result.exit_code}"
        sys.stdout.flush()
        sys.stderr.write(f"error: no profile was written ({script} {why}); run recorded in {result.run_dir}\n")
        return result.exit_code or 1
    except (OSError, ValidationError, ValueError) as exc:
        raise TpuAgentError(f"unreadable profile {path}: {exc}") from None

    if json_output:
        sys.stdout.write(prof.model_dump_json(indent=2) + "\n")
    else:
        from tpu_agent.cli.profile_view import render

        # Piped output is not cut to 80 columns: the tables stay readable in a log.
        render(prof, stdout if stdout.is_terminal else Console(width=max(stdout.width, 140), soft_wrap=True,
                                                                  highlight=False, color_system=None))
    return result.exit_code

