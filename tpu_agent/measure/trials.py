"""The parent side of timing trials: warm processes stepped under a gate.

`TrialProcess` runs the user's script (or a rewritten copy) with a plan in a
child process (started by the one launcher, `run.launch`) that stops at every
step boundary and reports the step (`run.messages`). `measure.runner` steps
two of them in alternation (A B A B ...). A crash, an out-of-memory error
or a step that hangs past its timeout ends the trial with a reason, never the
tool.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Literal

from tpu_agent import envvars, interrupts
from tpu_agent.plan.actions import Plan
from tpu_agent.run.launch import READ_STDIN, READ_STDIN_MARK, launch
from tpu_agent.run.messages import TRIAL_MESSAGE, Ended, StepRecord, TrialRequest

__all__ = ["StepRecord", "TrialFailed", "TrialProcess"]

STOP_GRACE_S = 3.0  # a child of a tune that is stopping gets this long to leave before SIGKILL

FailureKind = Literal["crashed", "out_of_memory", "timed_out", "too_few_steps", "not_finite"]


class TrialFailed(Exception):
    def __init__(self, kind: FailureKind, message: str, steps: int | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.steps = steps  # the steps the script finished before it ended, where it said


class TrialProcess:
    """One warm child process running the script with a plan, one step per `step()` call."""

    def __init__(self, script: Path, args: list[str], plan: Plan, *, cwd: Path, log_dir: Path,
                 step_timeout: float = 300.0, env: dict[str, str] | None = None, name: str = "trial"):
        self.script, self.args, self.plan = Path(script), list(args), plan
        self.cwd, self.log_dir, self.step_timeout = Path(cwd), Path(log_dir), step_timeout
        self.env = env or {}
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.notes: list[str] = []
        self.steps: list[StepRecord] = []
        self.warm_s: float | None = None  # start-up and warm-up (imports, compiles), set by Runner._warm
        self._buffer = b""

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        gate_read, self._gate = os.pipe()
        self._report, report_write = os.pipe()
        env = dict(os.environ)
        env.update(self.env)
        env[envvars.TRIAL.name] = TrialRequest(plan=self.plan, gate_fd=gate_read, report_fd=report_write).model_dump_json()
        self._log = open(self.log_dir / f"{self.name}.log", "wb")
        self.proc = launch(self.script, self.args, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=self._log,
                           stderr=subprocess.STDOUT, pass_fds=(gate_read, report_write), new_session=True)
        os.close(gate_read)
        os.close(report_write)
        ready = self._read(self.step_timeout + 120)  # imports, JAX start-up
        self.notes = list(getattr(ready, "notes", []))

    def step(self) -> StepRecord:
        self._go(b"g")
        record = self._read(self.step_timeout)
        if not isinstance(record, StepRecord):
            self._fail_from_end(record)
        self.steps.append(record)
        return record

    def stop(self) -> None:
        if self.proc is None:
            return
        if getattr(self, "_gate", None) is not None:
            try:
                self._go(b"q")
            except (BrokenPipeError, OSError):
                pass
        try:
            # Told to stop (Ctrl-C, SIGTERM, SIGHUP): it leaves at its next step boundary, or is stopped soon after
            self.proc.wait(timeout=STOP_GRACE_S if interrupts.stopping() else 30)
        except subprocess.TimeoutExpired:
            self._kill()
        self._close()

    # --- plumbing ------------------------------------------------------------------
    def _go(self, byte: bytes) -> None:
        os.write(self._gate, byte)

    def _read(self, timeout: float):
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise TrialFailed("timed_out", f"no step boundary within {timeout:.0f} s")
            ready, _, _ = select.select([self._report], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._report, 65536)
            if not chunk:  # the child is gone
                self._fail_from_exit()
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return TRIAL_MESSAGE.validate_json(line)

    def _fail_from_end(self, record) -> None:
        self._finish_process()
        end = record if isinstance(record, Ended) else Ended(status=1, error=f"unexpected {record.event!r} message")
        error = end.error or f"the script ended after {end.steps} steps"
        if READ_STDIN_MARK in error:
            error = f"{error} ({READ_STDIN})"
        kind = "too_few_steps" if end.status == 0 else _kind(error, self._tail())
        raise TrialFailed(kind, error if kind != "crashed" else f"{error}\n{self._tail()}", steps=end.steps)

    def _fail_from_exit(self) -> None:
        code = self._finish_process()
        if code == 0:  # it left on its own (os._exit(0), a sys.exit(0) past our hook): an end, not a crash
            raise TrialFailed("too_few_steps", f"the script exited with 0 after {len(self.steps)} steps",
                              steps=len(self.steps))
        tail = self._tail()
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with {code}"
        raise TrialFailed(_kind("", tail), f"the process {how}\n{tail}")

    def _finish_process(self) -> int:
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
            code = -9
        self._close()
        return code

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def _close(self) -> None:
        for fd in (getattr(self, "_gate", None), getattr(self, "_report", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._gate = self._report = None
        if not self._log.closed:
            self._log.close()

    def _tail(self, lines: int = 15) -> str:
        try:
            text = (self.log_dir / f"{self.name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        return False


_OOM_MARKERS = ("MemoryError", "RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kind(error: str, tail: str) -> str:
    text = f"{error}\n{tail}"
    return "out_of_memory" if any(m in text for m in _OOM_MARKERS) else "crashed"
