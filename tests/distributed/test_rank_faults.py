"""Faults in a distributed run on the tpu backend, world size 2 (issue #26 point 4): a rank that raises stops
the job with its own traceback and exit status, the launcher naming it as the root cause; a collective one rank
never joins times out with one line naming the op and that rank; a mesh the job cannot take, and a port in
use, are one `error:` line and exit 2; Ctrl-C ends every rank at once, one of them waiting at JAX's exit
barrier included (it took torchrun's 30 s grace and a SIGKILL). No process outlives a job."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from types import SimpleNamespace

import psutil
import pytest

from support.paths import TPU_AGENT
from support.processes import clean_env
from tpu_agent.backend.distributed.runtime import port_in_use

# Both ranks through one all_reduce, then each says it is ready, with the sum it got (4.0).
READY = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group(**TIMEOUT)
    rank = dist.get_rank()
    x = torch.ones(2, device="tpu")
    dist.all_reduce(x)
    print(f"rank {rank} ready, reduced {x.sum().item()}", flush=True)
""")

RAISING = READY.replace("**TIMEOUT", "") + textwrap.dedent("""
    if rank == 1:
        time.sleep(1)  # rank 0 waits in the all_reduce below by now
        raise ValueError("boom on rank 1")
    dist.all_reduce(x)
    print("rank 0 went on", flush=True)
""")

SKIPPING = READY.replace("**TIMEOUT", "timeout=timedelta(seconds=3)") + textwrap.dedent("""
    if rank == 0:
        dist.all_reduce(x)  # rank 1 skips it
    else:
        time.sleep(120)
""")

BAD_MESH = textwrap.dedent("""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    init_device_mesh("tpu", (3,))
""")

ONE_ALL_REDUCE = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group()
    x = torch.ones(2, device="tpu")
    dist.all_reduce(x)
    print("reduced", x.sum().item(), flush=True)
""")

# Rank 0 ends first and waits at JAX's exit barrier (in C++, where Python never sees Ctrl-C); rank 1 runs on.
UNEVEN = READY.replace("**TIMEOUT", "") + textwrap.dedent("""
    import atexit
    atexit.register(print, f"rank {rank} at exit", flush=True)  # runs first at exit: then JAX's exit barrier
    while rank == 1:
        time.sleep(0.1)
""")


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Job:
    """A launcher in its own session (as a terminal's foreground job), its output in files, and every process
    it started seen while it ran."""

    def __init__(self, argv: list[str], cwd, env=None):
        self.out, self.err = open(cwd / "stdout.txt", "w+"), open(cwd / "stderr.txt", "w+")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env or clean_env(), stdout=self.out, stderr=self.err,
                                     start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}
        self.ranks: set[int] = set()  # pids of the tool's child, once per rank

    def look(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
                argv = _cmdline(p) if p.pid not in self.ranks else []  # (a child just forked shows its parent's)
                if "tpu_agent.run.child" in argv and "tpu_agent.run.torchrun" not in argv:
                    self.ranks.add(p.pid)
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, text: str, count: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            self.look()
            self.out.seek(0)
            if self.out.read().count(text) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"{text!r} x{count} not printed:\n{self.stderr()[-3000:]}")

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > end:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise AssertionError(f"still running after {timeout} s:\n{self.stderr()[-3000:]}")
            self.look()
            time.sleep(0.05)
        return self.proc.returncode

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def left_behind(self) -> list[int]:
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=5)  # each one's end, or 5 s
        alive = [p for p in alive if _running(p)]
        for p in alive:
            p.kill()
        return [p.pid for p in alive]


def _tool_job(tmp_path, script: str, *args: str) -> Job:
    (tmp_path / "job.py").write_text(script)
    return Job([str(TPU_AGENT), "run", "--nproc", "2", "job.py", *args], tmp_path)


def _launcher_job(tmp_path, script: str, master_port: int) -> Job:
    """Our launcher module with a chosen --master-port (`tpu-agent run` lets torchrun pick a free one)."""
    (tmp_path / "job.py").write_text(script)
    return Job([sys.executable, "-m", "tpu_agent.run.torchrun", "--nproc-per-node=2", f"--master-port={master_port}",
                "--no-python", sys.executable, "-P", "-m", "tpu_agent.run.child", "job.py"], tmp_path)


def _once_ready(job: Job, exit_code: int) -> tuple[Job, float, str]:
    """Wait for both ranks to be ready, then for the job's end: (job, seconds from ready to the end, stderr)."""
    job.wait_for("ready", 2, timeout=120)
    start = time.monotonic()
    code = job.wait(timeout=60)
    took = time.monotonic() - start
    err = job.stderr()
    assert code == exit_code, err[-3000:]
    return job, took, err


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # a 2-rank job (about 9 s)
def test_a_rank_raising_while_the_other_waits_in_a_collective_stops_the_job_with_its_traceback(tmp_path):
    """Under our launcher with a chosen --master-port whose next port another process holds: JAX's coordinator takes
    a port rank 0 found free and shares through torchrun's store, where MASTER_PORT + 1 held by any other process
    (another job, another test) was `error: port ... in use` and exit 2 (seen in CI); both ranks' all_reduce before
    rank 1 raises shows the job was not stopped by it."""
    port = _two_free_ports()
    with socket.socket() as holder:
        holder.bind(("", port + 1))
        holder.listen()
        job, took, err = _once_ready(_launcher_job(tmp_path, RAISING, port), exit_code=1)
    assert took < 30, took  # JAX's exit barrier once held such a job 5 minutes
    assert "rank 0 ready, reduced 4.0" in job.stdout() and "rank 1 ready, reduced 4.0" in job.stdout()
    assert "ValueError: boom on rank 1" in err and "rank 0 went on" not in job.stdout()
    frames = [line for line in err.splitlines() if 'File "' in line]
    assert frames and all("job.py" in line for line in frames), frames  # the user's frames, none of ours
    root = err.split("Root Cause")[1]
    assert "rank      : 1 (local_rank: 1)" in root, root  # the rank that raised, not its partner
    assert "ValueError: boom on rank 1 (its traceback is above)" in root, root
    assert len(job.ranks) == 2
    assert job.left_behind() == []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.slow  # a 2-rank job and a 3 s timeout (about 13 s)
def test_a_collective_one_rank_skips_times_out_with_one_line_naming_the_op_and_the_rank(tmp_path):
    job, took, err = _once_ready(_tool_job(tmp_path, SKIPPING), exit_code=1)
    assert took < 20, took  # the group's 3 s, the watch's 1 s tick, the launcher's teardown
    lines = [line for line in err.splitlines() if line.startswith("tpu: rank 0: all_reduce")]
    assert lines == ["tpu: rank 0: all_reduce over ranks [0, 1] did not complete within 3 s (the process group's "
                     "timeout): rank 1 did not join it (this is collective #2 over these ranks; rank 1 entered 1, "
                     "its last: all_reduce)"], err[-3000:]
    assert job.left_behind() == []


@pytest.mark.slow  # a 2-rank job (about 8 s)
def test_a_mesh_the_job_cannot_take_is_one_error_line_and_exit_2(tmp_path):
    job = _tool_job(tmp_path, BAD_MESH)
    code = job.wait(timeout=120)
    err = job.stderr()
    assert code == 2, err[-3000:]
    assert _error_lines(err) == ["error: init_device_mesh('tpu', (3,)): a mesh of 3 ranks cannot be laid over this "
                                 "job's 2 ranks (WORLD_SIZE); launch 3 ranks (--nproc 3) or give a shape whose "
                                 "product is 2"], err
    assert "Traceback" not in err
    assert job.left_behind() == []


def _two_free_ports() -> int:
    """A port P with P and P + 1 both free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port < 65535 and not any(port_in_use(p) for p in (port, port + 1)):
            return port
    pytest.skip("no two consecutive free ports")


def test_a_port_in_use_is_one_error_line_and_exit_2(tmp_path):
    """The launcher's MASTER_PORT taken: the launcher stops (about 4 s)."""
    port = _two_free_ports()
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        job = _launcher_job(tmp_path, ONE_ALL_REDUCE, port)
        code = job.wait(timeout=120)
    err = job.stderr()
    assert code == 2, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and f"port {port} " in lines[0] and "in use" in lines[0], err
    assert "--master-port" in lines[0]
    assert job.left_behind() == []


def test_without_torchruns_store_the_port_next_to_master_port_in_use_is_one_error_line_and_exit_2(tmp_path):
    """Rank 0 of a job started by hand (its variables, no launcher's store): its coordinator's port is
    MASTER_PORT + 1, and that port held is one line naming it, exit 2, before JAX binds it."""
    port = _two_free_ports()
    (tmp_path / "job.py").write_text("import torch\nprint(torch.ones(2, device='tpu').sum().item())\n")  # joins JAX
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    with socket.socket() as holder:
        holder.bind(("", port + 1))
        holder.listen()
        job = Job([sys.executable, "-P", "-m", "tpu_agent.run.child", "job.py"], tmp_path, env=env)
        code = job.wait(timeout=60)
    err = job.stderr()
    assert code == 2, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and f"port {port + 1} " in lines[0] and "in use" in lines[0], err
    assert "--master-port" in lines[0]


def test_a_job_without_torchruns_store_takes_the_port_next_to_master_port():
    from tpu_agent.backend.distributed import runtime

    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    launch = runtime.from_environment(env)
    assert launch.coordinator == "127.0.0.1:29501"
    assert runtime._through_the_store(launch, env) is launch


@pytest.mark.slow  # a 2-rank job (about 9 s)
def test_ctrl_c_ends_every_rank_promptly_one_waiting_at_the_exit_barrier_included(tmp_path):
    job = _tool_job(tmp_path, UNEVEN)
    job.wait_for("ready", 2, timeout=120)
    job.wait_for("rank 0 at exit", 1, timeout=120)  # its script is done: next, JAX's exit barrier
    job.look()
    start = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGINT)  # as a terminal sends it: to the whole foreground job
    code = job.wait(timeout=60)
    took = time.monotonic() - start
    assert code == 130, job.stderr()[-3000:]
    assert took < 10, took  # it was 30 s: torchrun's grace, then SIGKILL
    assert job.left_behind() == []


def _failure(exitcode: int, timestamp: int, kind: str | None = None):
    from tpu_agent.backend.distributed.faults import ERROR_KIND

    extra = {"timestamp": str(timestamp), ERROR_KIND: kind}
    data = {"message": {"message": "m", "extraInfo": extra}} if kind else {}
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file_data=data)


def test_the_root_cause_is_the_rank_that_failed_not_its_consequences():
    from tpu_agent.backend.distributed import faults
    from tpu_agent.run.torchrun import exit_code, root_cause

    # rank 0's collective failed because rank 1 left; rank 2 was stopped by the launcher
    failures = {0: _failure(1, 10, faults.CONSEQUENCE), 1: _failure(3, 10), 2: _failure(-signal.SIGTERM, 9)}
    assert root_cause(failures)[0] == 1 and exit_code(root_cause(failures)[1].exitcode) == 3
    # a rank killed by the OOM killer is still the cause when its partner only followed it
    failures = {0: _failure(1, 10, faults.CONSEQUENCE), 1: _failure(-signal.SIGKILL, 10)}
    assert root_cause(failures)[0] == 1 and exit_code(root_cause(failures)[1].exitcode) == 137
    # a rank that timed out says so; its partner's abort comes after
    failures = {0: _failure(-signal.SIGABRT, 10), 1: _failure(1, 10, faults.CAUSE)}
    assert root_cause(failures)[0] == 1


def test_the_timeout_line_says_the_default_and_every_rank_that_did_not_join():
    from tpu_agent.backend.distributed import faults

    group = faults._Group(store=None, rank=0, timeout_s=faults.DEFAULT_TIMEOUT.total_seconds(), timeout_given=False)
    waiting = faults._Waiting("all_gather", (0, 1, 2, 3), 5, 0.0)
    line = faults.timeout_line(waiting, group, {1: (5, "all_gather"), 2: (4, "broadcast"), 3: None})
    assert line == ("tpu: rank 0: all_gather over ranks [0, 1, 2, 3] did not complete within 10 min (the default; "
                    "init_process_group(timeout=...) sets it): ranks [2, 3] did not join it (this is collective #5 "
                    "over these ranks; rank 2 entered 4, its last: broadcast; rank 3 entered none)")
    line = faults.timeout_line(waiting, group, {1: (5, "barrier"), 2: (5, "all_gather"), 3: (5, "all_gather")})
    assert "rank 1 is in barrier instead" in line
    assert faults.TORCH_DEFAULT_TIMEOUT == timedelta(minutes=30)
