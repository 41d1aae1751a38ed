"""The one child launcher: a user's script in a fresh child process, and the record of a run.

A child per run keeps the user's globals, device state and crashes out of the
tool, and gives each tuning trial a clean process to time. `launch` starts
every child (runs, profiles, timing trials); `run_script` waits for one and
records it in `run.json`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel

from tpu_agent import envvars, interrupts
from tpu_agent.paths import new_run_dir, write_atomic

SCHEMA_VERSION = 1
RUN_DIR_ENV = envvars.RUN_DIR.name  # tells the child (and its hooks) where to write
RESULT_FILE = "run.json"
# Past a deadline the launcher of N ranks gets longer than a child to stop: it gives its ranks (each in a session
# of its own, out of our reach) up to 30 s after its SIGTERM before it SIGKILLs them; killed sooner, it leaves
# them running.
LAUNCHER_GRACE_S = 40.0


class RunResult(BaseModel):
    schema_version: int = SCHEMA_VERSION
    script: str
    args: list[str]
    cwd: str
    command: list[str]
    run_dir: str
    started_at: datetime
    duration_s: float
    exit_code: int  # as a shell reports it: death by signal N is 128 + N
    signal_number: int | None = None  # set when the child died by a signal
    timed_out: bool = False  # stopped by us: past its time limit
    interrupted: bool = False  # Ctrl-C reached us while it ran

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


READ_STDIN_MARK = "EOF when reading a line"  # input() with stdin at the null device
READ_STDIN = "the script waits for terminal input, which a tune's processes do not get (their stdin is the null device)"


def child_command(script: str | Path, args: Sequence[str], nproc: int = 1) -> list[str]:
    """The child's command line; with `nproc` > 1, PyTorch's launcher (torch.distributed.run, as `torchrun
    --standalone --nproc-per-node N`) starting that child once per rank (run/torchrun.py: torchrun itself,
    exiting with the failed rank's exit code)."""
    # -P: nothing is prepended to sys.path for us; the child puts the script's dir there.
    child = [sys.executable, "-P", "-m", "tpu_agent.run.child", str(script), *args]
    if nproc <= 1:
        return child
    return [sys.executable, "-P", "-m", "tpu_agent.run.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "--no-python", *child]


def launch(script: str | Path, args: Sequence[str], *, env: Mapping[str, str], cwd: Path | None = None,
           stdin=None, stdout=None, stderr=None, pass_fds: Sequence[int] = (),
           new_session: bool = False, nproc: int = 1) -> subprocess.Popen:
    """Start `python -P -m tpu_agent.run.child SCRIPT ARGS...` (what the child does is in `env`), once per
    rank under torch.distributed.run when `nproc` > 1. `stdin`: inherited unless given (a tune's processes
    get the null device: no one answers a prompt there). `TPU_AGENT_ONE_RANK=1` in `env` (tune --nproc 1): a
    one-process child gets torchrun's variables for a group of one, a free MASTER_PORT each (a tune's warm
    processes run side by side)."""
    env = dict(env)
    if envvars.ONE_RANK.read(env) and nproc == 1:
        from tpu_agent.run.rendezvous import one_rank_variables

        env.update(one_rank_variables(env))
    envvars.ONE_RANK.pop(env)
    return subprocess.Popen(child_command(script, args, nproc), cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                            stderr=stderr, pass_fds=tuple(pass_fds), start_new_session=new_session)


def _wait(proc: subprocess.Popen[bytes], deadline: Callable[[], float] | None = None,
          grace: float = 5.0) -> tuple[int, bool, bool]:
    """Wait for the child, letting it handle Ctrl-C; pass SIGTERM and SIGHUP on to it (the child stops as it
    would have, and the wait ends as interrupted, the signal remembered for our exit code: 128 + N); stop it past
    `deadline()` (a monotonic time, asked again each time round). (exit status, timed out, interrupted)."""
    signalled: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        signalled.append(signum)
        interrupts.note_signal(signum)
        if proc.poll() is None:
            proc.send_signal(signum) if len(signalled) < 3 else proc.kill()  # asked a third time: no more waiting

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in interrupts.STOP_SIGNALS} if in_main_thread else {}
    ctrl_c = 0
    timed_out = False
    try:
        while True:
            try:
                if deadline is None or timed_out:
                    return proc.wait(), timed_out, ctrl_c > 0 or bool(signalled)
                left = deadline() - time.monotonic()
                if left > 0:
                    return proc.wait(timeout=min(left, 1.0)), False, ctrl_c > 0 or bool(signalled)
                timed_out = True
                _stop(proc, grace)
            except subprocess.TimeoutExpired:
                continue
            except KeyboardInterrupt:
                # The terminal sent SIGINT to the child too; it decides what to do.
                # If it ignores repeated Ctrl-C, we escalate.
                ctrl_c += 1
                if ctrl_c == 2:
                    proc.terminate()
                elif ctrl_c >= 3:
                    proc.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_script(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    runs_root: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    pass_fds: Sequence[int] = (),
    monitor: Callable[[subprocess.Popen[bytes]], AbstractContextManager[object]] | None = None,
    timeout: float | None = None,
    deadline: Callable[[], float] | None = None,
    run_dir: Path | None = None,
    nproc: int = 1,
) -> RunResult:
    """Run `script` with `args` as `python script args` would, in the current cwd.

    stdin, stdout and stderr are inherited unless `stdout`/`stderr` say
    otherwise (a file descriptor, or `subprocess.PIPE` for a `monitor` to
    relay), so the user sees their script's output and traceback live.
    `monitor(proc)` is entered while the child runs (a progress display).
    The result is also written to `run.json` in the new run directory.
    `timeout` (seconds in all) or `deadline()` (a monotonic time, asked as
    the child runs) stops the child when passed (`timed_out` in the result).
    `run_dir` is a run directory made already (`run --plan` writes its rewritten copy there).
    `nproc` > 1: one child per rank, started by torch.distributed.run (`child_command`).
    """
    run_dir = run_dir if run_dir is not None else new_run_dir(Path(script), runs_root)
    command = child_command(script, args, nproc)  # as given: the child resolves it like python does
    child_env = dict(os.environ if env is None else env)
    child_env[RUN_DIR_ENV] = str(run_dir)

    started_at = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    if timeout is not None and deadline is None:
        end = time.monotonic() + timeout
        deadline = lambda: end  # noqa: E731
    proc = launch(script, args, env=child_env, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
                  nproc=nproc)
    with monitor(proc) if monitor is not None else nullcontext():
        returncode, timed_out, interrupted = _wait(proc, deadline, LAUNCHER_GRACE_S if nproc > 1 else 5.0)
    duration = time.perf_counter() - t0

    sig = -returncode if returncode < 0 else None
    result = RunResult(
        script=os.path.abspath(script),
        args=list(args),
        cwd=os.getcwd(),
        command=command,
        run_dir=str(run_dir),
        started_at=started_at,
        duration_s=duration,
        exit_code=128 + sig if sig is not None else returncode,
        signal_number=sig,
        timed_out=timed_out,
        interrupted=interrupted,
    )
    write_atomic(run_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n", "the run record")
    return result
