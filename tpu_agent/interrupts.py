"""Ctrl-C is never lost: a KeyboardInterrupt that lands inside a `__del__`, a weakref callback or a finaliser
is printed by Python as "Exception ignored" and the program runs on (a tune's baseline then ran to its end, or
slept on, after Ctrl-C). Such an interrupt is raised again in the main thread."""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time


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
