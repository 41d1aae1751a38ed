"""What a rank does when its job goes wrong, so that a distributed run ends, and says why, instead of hanging.

- Every tpu collective runs inside `watching(op, ranks)`. A thread of the rank publishes, about once a second
  and only when it changed, how many collectives it has entered over each group (in the group's store: the
  launcher's TCPStore). A collective still running after its group's timeout ends the rank with one line
  naming the op and the ranks that did not join it: XLA cannot cancel a running collective, so the rank
  exits, as NCCL's watchdog ends a process. The timeout is `init_process_group(timeout=...)`'s; left unset
  (torch passes its 30 min default), it is 10 min, NCCL's default, what a script written for GPUs had.
- A collective that fails because another rank's process ended (gloo: connection closed) ends this rank
  with one line, not a traceback through this package, marked in torchrun's error file as a consequence,
  so that the launcher reports the rank that failed first (tpu_agent/run/torchrun.py).
- A mesh the job cannot take (`init_device_mesh("tpu", (3,))` at world size 2) and a port in use are one
  `error:` line and exit 2 (`usage_error`): written to torchrun's error file for the launcher to print once
  (printed here when there is no such file).
What the watch keeps (the groups, the collectives entered, the one running, its thread) lives in
STATE.distributed.faults. No torch, no JAX here.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from tpu_agent.partner_gone import CONSEQUENCE_MARK, gloo_partner_gone

from ..core.state import STATE

TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default_pg_timeout: what a group gets when none is given
DEFAULT_TIMEOUT = timedelta(minutes=10)  # NCCL's default
TICK_S = 1.0  # how often the watch thread publishes this rank's progress and looks at its running collective
STOP_WAIT_S = 10.0  # at exit, how long to wait for the thread's store call in flight (a store answers in ms)
PROGRESS_KEY = "tpu-agent/progress/{rank}"

# torchrun's error file (TORCHELASTIC_ERROR_FILE) carries what kind of failure a rank's was, for the launcher.
ERROR_KIND = "tpu_agent_kind"
CONSEQUENCE = "consequence"  # this rank stopped because another one had
USAGE = "usage"  # bad input: one line, exit 2
CAUSE = "cause"

EXIT_FAILED = 1
EXIT_USAGE = 2


@dataclass(frozen=True)
class _Group:
    store: object  # the group's c10d store (set, get, check)
    rank: int  # this process's global rank
    timeout_s: float
    timeout_given: bool


@dataclass(frozen=True)
class _Waiting:
    op: str
    ranks: tuple[int, ...]
    number: int  # this rank's n-th collective over these ranks
    since: float  # time.monotonic()


def attach(ranks, store, rank: int, timeout: timedelta) -> None:
    """Watch collectives over `ranks` (a tpu process group's global ranks) with the group's store and timeout.
    Called when the group is made; of groups with the same ranks, the last made is watched (every rank makes
    its groups in the same order; a job that destroys its group and makes another goes on being watched)."""
    ranks = tuple(ranks)
    given = timeout != TORCH_DEFAULT_TIMEOUT
    group = _Group(store, rank, (timeout if given else DEFAULT_TIMEOUT).total_seconds(), given)
    state = STATE.distributed.faults
    count, op = state.entered.get(ranks, (0, "-"))  # ranks -> (collectives entered over them, the last op)
    store.set(PROGRESS_KEY.format(rank=rank), f"{count} {op}")  # there from the start: absent, not a member yet
    state.groups[ranks] = group
    _start()


def _start() -> None:
    state = STATE.distributed.faults
    if state.thread is not None:
        return
    _install_excepthook()
    state.leaving = threading.Event()
    state.thread = threading.Thread(target=_watch, args=(state.leaving,), name="tpu-collective-watch", daemon=True)
    state.thread.start()
    atexit.register(_stop_watching)


def _stop_watching() -> None:
    """At exit, before the interpreter finalizes: the thread leaves between two store calls. A daemon thread
    still inside one (a pybind call, the GIL released) when finalization begins is ended by CPython as it takes
    the GIL back, and that unwinds through C++ that cannot be unwound: `terminate called without an active
    exception`, SIGABRT, a rank that did all its work and exits 134 (tests/distributed/test_watch_exit.py)."""
    state = STATE.distributed.faults
    if state.thread is None:
        return
    state.leaving.set()
    state.thread.join(STOP_WAIT_S)


class watching:  # noqa: N801 - used as a context manager, named as one
    """`with watching("all_reduce", ranks):` around the call that runs a collective. Cheap: a few attribute
    writes (the watch thread does the rest)."""

    __slots__ = ("op", "ranks", "outer")

    def __init__(self, op: str, ranks: tuple[int, ...]):
        self.op, self.ranks = op, ranks

    def __enter__(self) -> None:
        state = STATE.distributed.faults
        number = state.entered.get(self.ranks, (0, ""))[0] + 1
        state.entered[self.ranks] = (number, self.op)
        self.outer = state.current
        state.current = _Waiting(self.op, self.ranks, number, time.monotonic())

    def __exit__(self, kind, value, tb) -> bool:
        STATE.distributed.faults.current = self.outer
        if value is not None and another_rank_left(value):
            stop(f"tpu: rank {_my_rank(self.ranks)}: {self.op} over ranks {list(self.ranks)} stopped: "
                 f"{_partner_gone(value)}", CONSEQUENCE, EXIT_FAILED)
        return False


def partner_gone(value: BaseException) -> None:
    """End this rank, a consequence: `value` says a partner's process ended first."""
    stop(f"tpu: rank {os.environ.get('RANK', '?')}: stopped: {_partner_gone(value)}", CONSEQUENCE, EXIT_FAILED)


def _partner_gone(value: BaseException) -> str:
    reason = " ".join(str(value).split())
    reason = reason[reason.find("Connection"):] if "Connection" in reason else reason
    return f"{CONSEQUENCE_MARK} (gloo: {reason})"


def another_rank_left(exc: BaseException) -> bool:
    """A collective's error that says a partner's process went away (its sockets closed), not a fault here."""
    return gloo_partner_gone(str(exc))


def _my_rank(ranks) -> int | str:
    group = STATE.distributed.faults.groups.get(tuple(ranks))
    return group.rank if group is not None else os.environ.get("RANK", "?")


# --- the watch thread ------------------------------------------------------------------------------------------

def _watch(leaving: threading.Event) -> None:
    state = STATE.distributed.faults
    published: dict[int, tuple[int, str]] = {}  # id of a group -> what it was told last
    while not leaving.wait(TICK_S):
        for ranks, group in list(state.groups.items()):
            try:
                entered = state.entered.get(ranks)
                if entered is not None and entered != published.get(id(group)):
                    group.store.set(PROGRESS_KEY.format(rank=group.rank), f"{entered[0]} {entered[1]}")
                    published[id(group)] = entered
                waiting = state.current
                if (waiting is not None and waiting.ranks == ranks
                        and time.monotonic() - waiting.since > group.timeout_s):
                    stop(timeout_line(waiting, group, _progress_of(ranks, group)), CAUSE, EXIT_FAILED)
            except (RuntimeError, OSError):  # its store gone (the group destroyed): no longer watched
                if state.groups.get(ranks) is group:
                    del state.groups[ranks]


def _progress_of(ranks, group: _Group) -> dict[int, tuple[int, str] | None]:
    """Each other rank's published (collectives entered, last op); None where it never published."""
    out: dict[int, tuple[int, str] | None] = {}
    for r in ranks:
        if r == group.rank:
            continue
        key = PROGRESS_KEY.format(rank=r)
        if not group.store.check([key]):
            out[r] = None
            continue
        count, _, op = group.store.get(key).decode().partition(" ")
        out[r] = (int(count), op)
    return out


def timeout_line(waiting: _Waiting, group: _Group, progress: dict[int, tuple[int, str] | None]) -> str:
    """One line: the op, the ranks, the timeout and which ranks did not join (from their published progress)."""
    span = _span(group.timeout_s)
    limit = (f"{span} (the process group's timeout)" if group.timeout_given
             else f"{span} (the default; init_process_group(timeout=...) sets it)")
    absent = {r: p for r, p in progress.items() if p is None or p[0] < waiting.number}
    elsewhere = {r: p for r, p in progress.items() if r not in absent and p[1] != waiting.op}
    if absent:
        done = "; ".join(f"rank {r} entered none" if p is None or p[0] == 0 else
                         f"rank {r} entered {p[0]}, its last: {p[1]}" for r, p in absent.items())
        who = f"{_ranks_word(absent)} did not join it (this is collective #{waiting.number} over these ranks; {done})"
    elif elsewhere:
        who = "; ".join(f"rank {r} is in {p[1]} instead" for r, p in elsewhere.items())
        who += f" (collective #{waiting.number} over these ranks)"
    else:
        who = "every rank joined it"
    return (f"tpu: rank {group.rank}: {waiting.op} over ranks {list(waiting.ranks)} did not complete within "
            f"{limit}: {who}")


def _ranks_word(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g} s"
    return f"{seconds / 60:g} min"


# --- ending the rank -------------------------------------------------------------------------------------------

def stop(line: str, kind: str, code: int, *, print_line: bool = True) -> None:
    """End this process now with `line` (printed, and in torchrun's error file with its kind) and `code`.
    os._exit: a rank blocked in XLA, or at JAX's exit barrier, cannot be ended any other way."""
    written = _write_error_file(line, kind)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if print_line or not written:
        try:
            os.write(2, (line + "\n").encode())
        except OSError:
            pass
    os._exit(code)


def usage_error(line: str) -> None:
    """Bad input found in a rank: `error: LINE`, exit 2; printed once by the launcher where it reads torchrun's
    error files (tpu_agent/run/torchrun.py), by this rank otherwise."""
    stop(f"error: {line}", USAGE, EXIT_USAGE, print_line=False)


def _write_error_file(line: str, kind: str, *, keep: bool = False) -> bool:
    """Tell the launcher what ended this rank. `keep`: leave a file already written (torch's @record's)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or (keep and os.path.exists(path)):
        return False
    data = {"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time())), ERROR_KIND: kind}}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def kind_of(error_file_data) -> str | None:
    """The kind a rank wrote in its torchrun error file (`ProcessFailure.error_file_data`); None: not ours."""
    message = error_file_data.get("message") if isinstance(error_file_data, dict) else None
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    return extra.get(ERROR_KIND) if isinstance(extra, dict) else None


def message_of(error_file_data) -> str | None:
    message = error_file_data.get("message") if isinstance(error_file_data, dict) else None
    return message.get("message") if isinstance(message, dict) else None


# --- a rank's own error; a mesh the job cannot take -------------------------------------------------------------

def _install_excepthook() -> None:
    """A script's error is named in torchrun's error file (the launcher's summary then names it, not "To enable
    traceback see..."), a cause unless it is gloo saying another rank left; `init_device_mesh` with a shape
    whose size is not the world size, which fails inside torch with a traceback, is one line and exit 2."""
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        line = mesh_misfit(value, tb)
        if line is not None:
            usage_error(line)
        if another_rank_left(value):  # a partner ended first (a collective outside a watch): one line, no traceback
            partner_gone(value)
        if not issubclass(kind, KeyboardInterrupt):
            text = " ".join(str(value).split())
            said = f"{kind.__name__}: {text}"[:500] if text else kind.__name__
            _write_error_file(f"{said} (its traceback is above)", CONSEQUENCE if another_rank_left(value) else CAUSE,
                              keep=True)
        previous(kind, value, tb)

    sys.excepthook = excepthook


def mesh_misfit(value, tb) -> str | None:
    """The line for an error raised inside torch's init_device_mesh whose mesh size is not WORLD_SIZE."""
    if not isinstance(value, (RuntimeError, ValueError)):
        return None
    try:
        world = int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        return None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "init_device_mesh" and frame.f_code.co_filename.endswith("device_mesh.py"):
            shape, device = frame.f_locals.get("mesh_shape"), frame.f_locals.get("device_type")
            try:
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                return None
            size = math.prod(shape)
            if size == world:
                return None
            return (f"init_device_mesh({device!r}, {shape}): a mesh of {size} ranks cannot be laid over this "
                    f"job's {world} ranks (WORLD_SIZE); launch {size} ranks (--nproc {size}) or give a shape "
                    f"whose product is {world}")
        tb = tb.tb_next
    return None
