"""A host's measuring slots: timed work (a process's warm-up, each A/B pair of steps) runs only while holding
one, so workers filling one study, or two tunes, on the same host never time their steps against each other.

On the bundled device the accelerator is the host's CPU: XLA's CPU client spreads each step over every core,
so two measurements at once time each other's load, not their plans. Four workers on this 2-core machine,
measuring at once, passed 2 of 21 A/A trials (a plan that changes nothing) as gains (docs/benchmarks.md).
The slots are file locks (fcntl.flock) in a per-user folder of the temporary directory: the kernel frees a
slot when its holder dies, SIGKILL included, so a killed worker never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tpu_agent import envvars

POLL_S = 0.005  # between tries when every slot is taken (a step takes milliseconds to seconds)


def count() -> int:
    """TPU_AGENT_MEASURE_SLOTS, else one per two cores: a measurement keeps about two cores busy (its step's
    process and XLA's threads), and at two workers per core pair the A/A ratios already spread."""
    return envvars.MEASURE_SLOTS.value or max(1, (os.cpu_count() or 1) // 2)


def folder() -> Path:
    path = Path(tempfile.gettempdir()) / f"tpu-agent-{os.getuid()}" / "measure-slots"
    path.mkdir(parents=True, exist_ok=True)
    return path


_held = threading.local()  # the slot this thread holds: a baseline restarted inside a pair keeps the pair's


@contextlib.contextmanager
def held(slots: int | None = None) -> Iterator[int]:
    """One of the host's slots (its index) for the block; waits while all are taken."""
    if getattr(_held, "slot", None) is not None:
        yield _held.slot
        return
    slots = count() if slots is None else slots
    files = [os.open(folder() / f"slot-{i}.lock", os.O_RDWR | os.O_CREAT, 0o600) for i in range(slots)]
    taken = None
    try:
        while taken is None:
            for i, fd in enumerate(files):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                taken = i
                break
            else:
                if slots == 1:  # one slot: the kernel queues the waiters
                    fcntl.flock(files[0], fcntl.LOCK_EX)
                    taken = 0
                else:
                    time.sleep(POLL_S)
        _held.slot = taken
        yield taken
    finally:
        _held.slot = None
        for fd in files:
            os.close(fd)  # closing the descriptor releases its lock
