"""Running an executable: the one place that aligns its inputs to the mesh, calls it, waits
when launch-blocking, counts and times it, and turns XLA's out-of-memory into PyTorch's.

Eager ops, fused graphs, replayed compiled steps and compiled module programs all run
through `launch`, so the profiler's counts and a script's `except torch.OutOfMemoryError`
see every one of them.
"""

from __future__ import annotations

import contextlib
import re
from time import perf_counter

import jax
import torch

from . import jax_setup, mesh
from .executables import Executable
from .state import STATE

_X64 = jax.enable_x64  # JAX's 64-bit switch (jax_setup.device_x64 turns it on for the device)


def launch(exe: Executable, args):
    """`exe.fn(*args)`, counted in `exe.calls` and `exe.time_s`. Always inside the device's 64-bit scope: a jitted
    function called outside it would trace again with 32-bit types and truncate int64 inputs silently."""
    if not _X64.value:  # a program run from outside an op (a compiled module's, a step's): scope it here
        with jax_setup.device_x64():
            return launch(exe, args)
    if STATE.mesh is not None:
        args = mesh.align(list(args))
    t0 = perf_counter()
    try:  # not out_of_memory_as_torch: a context manager costs microseconds on every op
        out = exe.fn(*args)
        if STATE.blocking:
            jax.block_until_ready(out)
    except jax.errors.JaxRuntimeError as exc:
        _raise_if_out_of_memory(exc, exe.name, exe.source)
        raise
    exe.calls += 1
    exe.time_s += perf_counter() - t0
    watch = STATE.memory_watch
    if watch is not None:  # the in-step peak, where the profiler or a trial measures it
        watch.launched(exe, out)
    return out


_ASKED = re.compile(r"allocat\w*\s+(\d+)\s+bytes", re.I)


@contextlib.contextmanager
def out_of_memory_as_torch(what: str, source: str | None = None):
    """Re-raise XLA's RESOURCE_EXHAUSTED as `torch.OutOfMemoryError` (what scripts catch to back off),
    naming the program or op and the bytes it asked for."""
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        _raise_if_out_of_memory(exc, what, source)
        raise


def _raise_if_out_of_memory(exc: Exception, what: str, source: str | None) -> None:
    message = str(exc)
    if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower():
        raise torch.OutOfMemoryError(_describe(what, source, message)) from None


def _describe(what: str, source: str | None, message: str) -> str:
    asked = _ASKED.search(message)
    size = f" asked for {_size(int(asked.group(1)))}" if asked else ""
    where = f" (at {source})" if source else ""
    first = message.strip().splitlines()[0] if message.strip() else "RESOURCE_EXHAUSTED"
    return f"tpu: out of device memory: {what}{where}{size}; XLA: {first}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
