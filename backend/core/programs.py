"""Programs: an op's lowering, a view read or write, a cast, jit-compiled once per key and
run now (eager) or recorded into the pending graph (fused)."""

from __future__ import annotations

import jax

from . import executables, lazy
from .launch import launch
from .lazy import RECORDER
from .state import STATE, STATS

PROGRAMS: dict[tuple, tuple] = {}  # view / cast programs, same shape


def new_program(name: str, kind: str, raw, args, jit: bool = True, source: str | None = None):
    exe = executables.Executable(
        name=name, kind=kind, fn=jax.jit(raw) if jit else raw,
        args=tuple(executables.abstract(a) for a in args), source=source,
    )
    if jit:
        executables.register(exe)
    STATS.compiles += 1
    program = lazy.Program(exe.id, name, raw, {}, scope=name if source is None else f"{name}[{source}]")
    return exe, program


def run_program(exe, program, args, jit: bool = True):
    """Run a program now (eager) or record it (fused); returns arrays or Lazy placeholders."""
    if jit and STATE.fused:
        return RECORDER.record(program, args)
    for a in args:
        if type(a) is lazy.Lazy:
            RECORDER.flush(lazy.DATA_DEPENDENT, also=args, op=program.name)
            args = [a.value if type(a) is lazy.Lazy else a for a in args]
            break
    return launch(exe, args)


def call_jax(key: tuple, name: str, raw, *args):
    """A small helper program (a view read or write, a cast), compiled once per key."""
    entry = PROGRAMS.get(key)
    if entry is None:
        entry = PROGRAMS[key] = new_program(name, "helper", raw, args)
    return run_program(*entry, args)
