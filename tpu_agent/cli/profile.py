"""`tpu-agent profile`: check the inputs, run the script under the profiler, show the profile.

The measuring happens in the child (`tpu_agent.profilers.session`, hooked in
by `tpu_agent.run.child`); this side
validates options before anything starts, shows progress while the script
runs (on a terminal) and renders the `profile.json` the child wrote.
"""

from __future__ import annotations

import codecs
import enum
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from tpu_agent import envvars
from tpu_agent.cli.inputs import check_script
from tpu_agent.cli.options import (NPROC_WITH_DEVICES, DeviceMapOption, NprocOption, ScriptArg, ScriptArgs,
                                    declared_option, device_map_env, stderr_console, stdout_console)
from tpu_agent.config import SHARED
from tpu_agent.errors import InputError, TpuAgentError
from tpu_agent.cli.format import ms
from tpu_agent.paths import CANNOT_WRITE_EXIT, RUNS_SUBDIR, CannotWrite, refusal_of_run, shown_path, writable_dir
from tpu_agent.profilers.schema import Settings

TIMED_OUT = 124  # as timeout(1) exits


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
        return {envvars.PROGRESS_FD.name: str(self.write_fd)}

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
        from pydantic import ValidationError

        from tpu_agent.run.messages import Progress as Message

        with os.fdopen(self.read_fd, "rb") as pipe:
            for raw in pipe:
                try:
                    message = Message.model_validate_json(raw)
                except ValidationError:
                    continue
                if message.event == "step" and message.step is not None:
                    progress.update(task, completed=message.step, description=f"profiling {self.script}: step "
                                    f"{message.step}, last {ms(message.wall_s)}")
                elif message.event == "analysing":
                    progress.update(task, description=f"profiling {self.script}: analysing executables")


def profile_script(
    script: str,
    script_args: list[str],
    *,
    settings: Settings,
    output_dir: Path | None,
    json_output: bool,
    stdout: Console,
    stderr: Console,
    timeout: float | None = None,
    device_map: str | None = None,
    nproc: int | None = None,
) -> int:
    """`nproc`: None runs the script as `python` would; 1 as one rank of a torchrun job; N > 1 N ranks."""
    from tpu_agent.run.profiled import gather_ranks, read_profile, refused_files, run_profiled
    from tpu_agent.run.rendezvous import one_rank_variables

    check_script(script)
    if nproc is not None and nproc < 1:
        raise InputError(f"--nproc takes a number of ranks >= 1, got {nproc}")
    launched = nproc == 1
    nproc = nproc or 1
    if nproc > 1 and settings.devices > 1:
        raise InputError(NPROC_WITH_DEVICES)
    mapped = device_map_env(device_map)
    if launched:  # a torchrun script at one rank: its init_process_group() finds a group of one
        mapped = {**mapped, **one_rank_variables(dict(os.environ))}
    if settings.trace_dir:
        settings.trace_dir = str(writable_dir(Path(settings.trace_dir).resolve(), "the trace directory"))
    runs_root = writable_dir(output_dir if output_dir is not None else Path.cwd() / RUNS_SUBDIR, "the output directory")

    display = None
    if stderr.is_terminal and not json_output and nproc == 1:  # the ranks' launcher passes no progress pipe on
        total = settings.warmup + settings.steps + settings.timed_steps() if settings.steps is not None else None
        display = ProgressDisplay(stderr, Path(script).name, total)
    try:
        result, path = run_profiled(
            script, script_args, settings, runs_root=runs_root, extra_env={**mapped, **(display.env() if display else {})},
            # --json: stdout carries the profile; the script's own output goes to stderr.
            stdout=subprocess.PIPE if display else (sys.stderr.fileno() if json_output else None),
            stderr=subprocess.PIPE if display else None,
            pass_fds=(display.write_fd,) if display else (),
            monitor=display, timeout=timeout, nproc=nproc,
        )
    except OSError as exc:
        raise TpuAgentError(f"could not start the run: {exc}") from None
    if nproc > 1:  # after a timeout too: the ranks' partial profiles, as a single run keeps its own
        gather_ranks(Path(result.run_dir), nproc, result.exit_code)

    if result.timed_out:
        sys.stdout.flush()
        sys.stderr.write(f"error: {script} ran past --timeout {timeout:g} s and was stopped; "
                         f"run recorded in {result.run_dir}\n")
        return TIMED_OUT
    try:
        prof = read_profile(path)
    except FileNotFoundError:
        if result.exit_code == CANNOT_WRITE_EXIT:  # the script finished; the environment refused its profile
            reason = refusal_of_run(result.run_dir)
            raise CannotWrite(f"cannot write the profile {shown_path(path)}: {reason} (the script ran to its end)")
        why = f"killed by signal {result.signal_number}" if result.signal_number else f"exit {result.exit_code}"
        sys.stdout.flush()
        sys.stderr.write(f"error: no profile was written ({script} {why}); run recorded in {result.run_dir}\n")
        return result.exit_code or 1
    except TpuAgentError as exc:  # a profile we cannot read: say so, keep the script's own exit code
        sys.stdout.flush()
        sys.stderr.write(f"error: {exc}; run recorded in {result.run_dir}\n")
        return result.exit_code or 1

    from tpu_agent.run.device_use import profile_touched, refusal

    if not profile_touched(prof):  # "0 FLOP", "MFU 0.0 %" would read as measured: say what happened instead
        sys.stdout.flush()
        sys.stderr.write(f"error: {refusal(script, 'profile')}; run recorded in {result.run_dir}\n")
        return result.exit_code or 1

    if json_output:
        sys.stdout.write(prof.model_dump_json(indent=2) + "\n")
    else:
        from tpu_agent.cli.profile_view import render

        # Piped output is not cut to 80 columns: the tables stay readable in a log.
        render(prof, stdout if stdout.is_terminal else Console(width=max(stdout.width, 140), soft_wrap=True,
                                                                  highlight=False, color_system=None))
    files_refused = refused_files(prof)  # its HLO files or plot: the figures shown above stand, the cause said
    if files_refused is not None:
        sys.stdout.flush()
        sys.stderr.write(f"error: {files_refused}\n")
        return result.exit_code or 1
    return result.exit_code


class ProfileMode(str, enum.Enum):
    eager = "eager"
    fused = "fused"
    compiled = "compiled-if-available"


def target_generation(target: str) -> str | None:
    """The generation --target models (a slice's: v5e-8 is v5e); None for cpu, this machine (no estimate).
    A target neither names is click's usage error (exit 2, one line)."""
    from tpu_agent.config import check_target
    from tpu_agent.config import target_generation as generation

    try:
        check_target(target)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--target'") from None
    chosen = generation(target)
    return None if chosen == "cpu" else chosen


def _default(name: str):
    """A profile option's default, as the profiler's Settings declares it (one copy)."""
    return Settings.model_fields[name].default


def profile(
    script: ScriptArg,
    script_args: ScriptArgs = None,
    steps: Annotated[
        int | None,
        typer.Option("--steps", min=1, help="Stop the script cleanly after N measured steps (after warm-up). Default: run it to the end.", show_default=False),
    ] = None,
    warmup: Annotated[int, declared_option("warmup")] = SHARED["warmup"].default,
    mode: Annotated[ProfileMode, typer.Option("--mode", help="How the device runs ops: op by op, fused into one program per step, or compiled where the backend can.")] = ProfileMode(_default("mode")),
    devices: Annotated[int, typer.Option("--devices", min=1, help="Simulate N devices on the CPU.")] = _default("devices"),
    target: Annotated[str, declared_option("target")] = SHARED["target"].default,
    dump_hlo: Annotated[bool, typer.Option("--dump-hlo/--no-dump-hlo", help="Write the optimized HLO of every executable that ran to the run directory.")] = _default("dump_hlo"),
    xla_dump: Annotated[bool, typer.Option("--xla-dump", help="Also turn on XLA's own dump (--xla_dump_to) into the run directory.")] = _default("xla_dump"),
    trace: Annotated[
        Path | None,
        typer.Option("--trace", metavar="DIR", help="Record a jax.profiler trace of the measured steps (TensorBoard/XProf, Perfetto).", show_default=False),
    ] = None,
    time_executables: Annotated[bool, typer.Option("--time-executables", help="Wait for every executable so its recorded time is execution time (slower).")] = _default("time_executables"),
    host_device_steps: Annotated[int, typer.Option("--host-device-steps", min=0, metavar="K", help="Run K more steps (after the measured ones) with every executable waited for, to split the step into host overhead and device time; 0: none.")] = _default("host_device_steps"),
    output_dir: Annotated[Path | None, declared_option("output_dir")] = SHARED["output_dir"].default,
    json_output: Annotated[bool, typer.Option("--json", help="Print profile.json to stdout (the script's output goes to stderr).")] = False,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", min=0.001, metavar="SECONDS", help="Stop the script after this many seconds (exit 124).", show_default=False),
    ] = None,
    device_map: DeviceMapOption = None,
    nproc: NprocOption = SHARED["nproc"].default,
) -> int:
    """Profile SCRIPT on the bundled `tpu` device: step time, FLOPs, MFU, memory, hot ops, padding waste.

    Steps are found without changing the script (every optimizer step, or
    torch.tpu.mark_step()). Writes profile.json, HLO files and a step-time plot
    to .tpu-agent/runs/<time>-<script>/. The exit code is the script's own; a run that put no work
    on tpu has no device figures to show (one line, exit 1).
    Example: [bold]tpu-agent profile train.py --steps 10 -- --epochs 1[/bold];
    [bold]tpu-agent profile --nproc 2 train.py --steps 10[/bold]
    """
    settings = Settings(
        steps=steps, warmup=warmup, mode=mode.value, devices=devices, target=target_generation(target),
        dump_hlo=dump_hlo, xla_dump=xla_dump, trace_dir=str(trace) if trace else None,
        time_executables=time_executables, host_device_steps=host_device_steps,
    )
    return profile_script(script, script_args or [], settings=settings, output_dir=output_dir,
                          json_output=json_output, stdout=stdout_console(), stderr=stderr_console(), timeout=timeout,
                          device_map=device_map, nproc=nproc)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)
