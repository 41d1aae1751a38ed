"""Which XLA programs a step ran, as one fingerprint: two processes whose steps run the same programs the same
number of times do the same device work, so a plan whose step fingerprints as the baseline's changes nothing
there (measure/runner.py then calls it "no change" and never measures it).

A program is fingerprinted by its lowered StableHLO text (shapes, dtypes, shardings, precision attributes; no
source locations) without the module's name, which counts programs in the order a process made them."""

from __future__ import annotations

import hashlib
import re

_MODULE_NAME = re.compile(r"^module @\S+", re.MULTILINE)


def calls() -> dict[int, int]:
    """Each program's call count so far (the device's executables), by id."""
    from tpu_agent.backend.core import executables

    return {exe.id: exe.calls for exe in executables.all()}


def _text(exe) -> str:
    text = getattr(exe, "_programs_text", None)
    if text is None:
        from tpu_agent.backend.core.jax_setup import device_x64

        with device_x64():  # lowered as the device runs it (outside, int64 arguments would lower as int32)
            text = _MODULE_NAME.sub("module", exe.fn.lower(*exe.args).as_text())
        exe._programs_text = text  # one lowering per program per process
    return text


def fingerprint(before: dict[int, int]) -> str | None:
    """The programs run since `before` (calls(), taken at a step's start), each with how often: a digest of the
    sorted (program text, calls) pairs. None when a program cannot be lowered again (then nothing is claimed)."""
    from tpu_agent.backend.core import executables

    ran = []
    for exe in executables.all():
        n = exe.calls - before.get(exe.id, 0)
        if n <= 0:
            continue
        try:
            text = _text(exe)
        except Exception:  # noqa: BLE001 - a program not lowerable from its kept arguments: unknown
            return None
        ran.append(f"{n}\n{text}")
    digest = hashlib.sha256()
    for item in sorted(ran):
        digest.update(hashlib.sha256(item.encode()).digest())
    return f"{len(ran)}:{digest.hexdigest()[:32]}"
