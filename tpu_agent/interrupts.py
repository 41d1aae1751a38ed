"""Ctrl-C is never lost: a KeyboardInterrupt that lands inside a `__del__`, a weakref callback or a finaliser
is printed by Python as "Exception ignored" and the program runs on (a tune's baseline then ran to its end, or
slept on, after Ctrl-C). Such an interrupt is raised again in the main thread. SIGTERM and SIGHUP stop a tune
as Ctrl-C does (`stop_signals_interrupt`); the exit code then says which signal (128 + N)."""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
from contextlib import contextmanager


def keep_swallowed_interrupts() -> None:
    """Install the hook (once per process); only where Ctrl-C raises KeyboardInterrupt (not ignored)."""
    if getattr(sys.unraisablehook, "_tpu_agent", False):
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # From another thread, once this hook has returned: raised here, it would be ignored again (and
            # should it land in another finaliser, this hook sends it once more).
            threading.Thread(target=_interrupt_main_soon, daemon=True).start()
            return
        previous(unraisable)

    hook._tpu_agent = True
    sys.unraisablehook = hook


def _interrupt_main_soon() -> None:
    time.sleep(0.05)
    _thread.interrupt_main()


# --- SIGTERM and SIGHUP: stopped as Ctrl-C stops a tune -------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_received: int | None = None  # the last stop signal this process received (SIGTERM, SIGHUP), None: none


def note_signal(signum: int) -> None:
    """Remember a stop signal: the exit code says which one stopped the tune (128 + N)."""
    global _received
    _received = signum


def received() -> int | None:
    return _received


def exit_code() -> int:
    """An interrupted command's exit code: 128 + N for the stop signal N it received, else 130 (Ctrl-C)."""
    return 128 + _received if _received is not None else 130


def stopping() -> bool:
    """Whether the process is stopping: a stop signal came, or a KeyboardInterrupt is being handled (a finaliser
    or a `finally` on its way out): children are then stopped without the long courtesy wait."""
    return _received is not None or isinstance(sys.exc_info()[1], KeyboardInterrupt)


def _raise_interrupt(signum: int, _frame: object) -> None:
    note_signal(signum)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextmanager
def stop_signals_interrupt():
    """While inside, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does, so every
    phase's one interrupt path (children stopped, finished work kept, the report written) serves them too; the
    signal is remembered for the exit code. Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
