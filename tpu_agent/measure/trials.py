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
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal

from tpu_agent import envvars, interrupts
from tpu_agent.partner_gone import CONSEQUENCE_MARK, gloo_partner_gone
from tpu_agent.plan.actions import Plan
from tpu_agent.run.launch import LAUNCHER_GRACE_S, READ_STDIN, READ_STDIN_MARK, launch
from tpu_agent.run.messages import TRIAL_MESSAGE, Ended, StepRecord, TrialRequest, channel_paths

__all__ = ["RankedStep", "StepRecord", "TrialFailed", "TrialProcess", "rank_records"]

STOP_GRACE_S = 3.0  # a child of a tune that is stopping gets this long to leave before SIGKILL

FailureKind = Literal["crashed", "out_of_memory", "timed_out", "too_few_steps", "not_finite", "no_change"]


class TrialFailed(Exception):
    def __init__(self, kind: FailureKind, message: str, steps: int | None = None):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.steps = steps  # the steps the script finished before it ended, where it said


class RankedStep(StepRecord):
    """One step of an N-rank job: the slowest rank's time (a distributed step ends when every rank ends it: the
    ranks start it together at the gate's go and each times it up to its own boundary, device synchronized),
    rank 0's loss, the most device bytes of any rank, and every rank's own record (`ranks`)."""

    ranks: list[StepRecord]

    @classmethod
    def of(cls, ranks: list[StepRecord]) -> "RankedStep":
        return cls(step=ranks[0].step, wall_s=max(r.wall_s for r in ranks), loss=ranks[0].loss,
                   device_bytes=max(r.device_bytes for r in ranks), compiled=any(r.compiled for r in ranks),
                   ranks=ranks)


def rank_records(record: StepRecord) -> list[StepRecord]:
    """Each rank's record of a step (one process: the step itself)."""
    return record.ranks if isinstance(record, RankedStep) else [record]


class TrialProcess:
    """One warm child process running the script with a plan, one step per `step()` call; with `nproc` > 1,
    PyTorch's launcher running it once per rank, every rank stepped together (a gate and a report each)."""

    def __init__(self, script: Path, args: list[str], plan: Plan, *, cwd: Path, log_dir: Path,
                 step_timeout: float = 300.0, env: dict[str, str] | None = None, name: str = "trial",
                 nproc: int = 1):
        self.script, self.args, self.plan = Path(script), list(args), plan
        self.cwd, self.log_dir, self.step_timeout = Path(cwd), Path(log_dir), step_timeout
        self.env = env or {}
        self.name = name
        self.nproc = nproc
        self.proc: subprocess.Popen | None = None
        self.notes: list[str] = []
        self.steps: list[StepRecord] = []
        self.warm_s: float | None = None  # start-up and warm-up (imports, compiles), set by Runner._warm
        self.programs: str | None = None  # a steady step's program fingerprint, where Runner asked for one
        self._gates: list[int] = []
        self._reports: list[int] = []
        self._buffers: list[bytes] = []
        self._channels: str | None = None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env)
        if self.nproc > 1:
            request, pass_fds = self._open_channels(), ()
        else:
            gate_read, gate = os.pipe()
            report, report_write = os.pipe()
            self._gates, self._reports, self._buffers = [gate], [report], [b""]
            request = TrialRequest(plan=self.plan, gate_fd=gate_read, report_fd=report_write)
            pass_fds = (gate_read, report_write)
        env[envvars.TRIAL.name] = request.model_dump_json()
        self._log = open(self.log_dir / f"{self.name}.log", "wb")
        self.proc = launch(self.script, self.args, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=self._log,
                           stderr=subprocess.STDOUT, pass_fds=pass_fds, new_session=True, nproc=self.nproc)
        for fd in pass_fds:
            os.close(fd)
        ready = self._read_all(self.step_timeout + 120)  # imports, JAX start-up (every rank joining the job)
        self.notes = list(dict.fromkeys(n for r in ready for n in getattr(r, "notes", [])))

    def _open_channels(self) -> TrialRequest:
        """A FIFO pair per rank in a fresh folder, both held open here (the gate read-write, so that a rank's open
        never waits and a rank sees EOF only when this process is gone; the report without blocking)."""
        self._channels = tempfile.mkdtemp(prefix="tpu-agent-trial-")
        for rank in range(self.nproc):
            gate, report = channel_paths(self._channels, rank)
            os.mkfifo(gate, 0o600)
            os.mkfifo(report, 0o600)
            self._gates.append(os.open(gate, os.O_RDWR))
            self._reports.append(os.open(report, os.O_RDONLY | os.O_NONBLOCK))
            self._buffers.append(b"")
        return TrialRequest(plan=self.plan, channels=self._channels)

    def step(self, programs: bool = False) -> StepRecord:
        """The next step; with `programs`, its record carries the fingerprint of the programs it ran."""
        self._go(b"p" if programs else b"g")
        records = self._read_all(self.step_timeout)
        if not all(isinstance(r, StepRecord) for r in records):  # a rank ended: the one that says why
            self._fail_from_end(*(_first_end(records) or (0, records[0])))
        record = records[0] if self.nproc == 1 else RankedStep.of(records)
        self.steps.append(record)
        return record

    def stop(self) -> None:
        if self.proc is None:
            return
        if self._gates:
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
        for gate in self._gates:
            os.write(gate, byte)

    def _read_all(self, timeout: float) -> list:
        """One message from every rank, each within `timeout` of now (they run together). When a rank is gone,
        the others are still read (the launcher stops them): a rank's own Ended says why better than the job's
        exit does."""
        deadline = time.monotonic() + timeout
        records = []
        for rank in range(len(self._reports)):
            try:
                records.append(self._read(rank, deadline, timeout))
            except _Gone:
                records.append(None)
        if None in records:
            end = _first_end(records)
            if end is not None and end[1].status != 0:
                self._fail_from_end(*end)
            self._fail_from_exit()
        return records

    def _read(self, rank: int, deadline: float, timeout: float):
        while b"\n" not in self._buffers[rank]:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise TrialFailed("timed_out", f"no step boundary within {timeout:.0f} s"
                                  + (f" (rank {rank})" if self.nproc > 1 else ""))
            ready, _, _ = select.select([self._reports[rank]], [], [], min(left, 1.0))
            if not ready:
                if self.nproc > 1 and self.proc.poll() is not None:  # the launcher is gone before this rank spoke
                    raise _Gone()
                continue
            chunk = os.read(self._reports[rank], 65536)
            if not chunk:  # the child is gone
                raise _Gone()
            self._buffers[rank] += chunk
        line, self._buffers[rank] = self._buffers[rank].split(b"\n", 1)
        return TRIAL_MESSAGE.validate_json(line)

    def _fail_from_end(self, rank: int, record) -> None:
        self._finish_process()
        end = record if isinstance(record, Ended) else Ended(status=1, error=f"unexpected {record.event!r} message")
        error = end.error or f"the script ended after {end.steps} steps"
        if READ_STDIN_MARK in error:
            error = f"{error} ({READ_STDIN})"
        if self.nproc > 1 and end.status != 0:
            error = f"rank {rank}: {error}"
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
        try:  # the launcher stops the other ranks first (SIGTERM, then SIGKILL 30 s later)
            code = self.proc.wait(timeout=30 if self.nproc == 1 else LAUNCHER_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill()
            code = -9
        self._close()
        return code

    def _kill(self) -> None:
        """SIGKILL to the child's process group; a launcher gets SIGTERM first, which it passes on to its ranks
        (each in a session of its own, out of our reach), and SIGKILL only past its grace."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.nproc > 1:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=LAUNCHER_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def _close(self) -> None:
        for fd in (*self._gates, *self._reports):
            try:
                os.close(fd)
            except OSError:
                pass
        self._gates, self._reports = [], []
        if self._channels is not None:
            shutil.rmtree(self._channels, ignore_errors=True)
            self._channels = None
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


def _first_end(records: list) -> tuple[int, Ended] | None:
    """(rank, its end) to report when some rank did not reach the step: a rank's own failure first, not one that
    only says another rank's process ended (backend/distributed/faults.py), then any failure, then a clean end."""
    ends = [(rank, r) for rank, r in enumerate(records) if isinstance(r, Ended)]
    failed = [(rank, e) for rank, e in ends if e.status != 0]
    causes = [(rank, e) for rank, e in failed if not _consequence(e.error or "")]
    return next(iter(causes or failed or ends), None)


def _consequence(error: str) -> bool:
    """A rank's line that only says a partner died: faults.py's own words, or gloo's when the collective ran inside
    a fused program (XLA raises it, not a watched collective); both in tpu_agent.partner_gone, which faults.py
    writes with."""
    return CONSEQUENCE_MARK in error or gloo_partner_gone(error)


class _Gone(Exception):
    """A rank's report closed (its process ended) or its launcher exited before it spoke."""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kind(error: str, tail: str) -> str:
    text = f"{error}\n{tail}"
    return "out_of_memory" if any(m in text for m in _OOM_MARKERS) else "crashed"
