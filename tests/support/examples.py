"""Running an example script as a user would, and reading its per-step losses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from support.paths import EXAMPLES

STEPS = 20
# The transformer's LM head (50257 columns) is ~10 GFLOP a step: one pass over its 4 batches.
STEPS_FOR = {"transformer": 4}
# Dropout masks come from each device's own RNG stream: compare with dropout off.
EXTRA = {"cnn": ["--dropout", "0"]}


def losses(name: str, device: str, *extra: str) -> list[float]:
    """The example's per-step losses; the CPU's are run once per test run and shared by every test and worker
    (the examples seed everything: a CPU rerun gives the same losses)."""
    if device != "cpu":
        return _run(name, device, *extra)[0]
    cached = _cpu_cache() / f"{name}-{'-'.join(extra) or 'plain'}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    values = _run(name, device, *extra)[0]
    partial = cached.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(values))
    partial.replace(cached)  # whole or not at all: another worker may be reading
    return values


def _cpu_cache() -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    path = Path(tempfile.gettempdir()) / f"tpu-agent-tests-cpu-losses-{run}"
    path.mkdir(exist_ok=True)
    return path


# The fused programs a run compiled and ran, printed after the script (`fused_programs`).
_REPORT_PROGRAMS = """\
import json, os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` has it (examples/training.py)
runpy.run_path(sys.argv[0], run_name="__main__")
from tpu_agent.backend.core import executables, lazy
print("PROGRAMS " + json.dumps({"calls": [e.calls for e in executables.all() if e.kind == "fused"],
                                "flushes": lazy.RECORDER.flushes, "recompiles": len(lazy.RECORDER.recompiles)}))
"""


def fused_programs(name: str, *extra: str) -> tuple[list[float], dict]:
    """The example's per-step losses on tpu, and its fused programs: each one's calls, the flushes (programs
    run) and the recompilations."""
    values, printed = _run(name, "tpu", *extra, programs=True)
    return values, json.loads(printed)


def _run(name: str, device: str, *extra: str, programs: bool = False) -> tuple[list[float], str]:
    steps = STEPS_FOR.get(name, STEPS)
    head = [sys.executable, "-c", _REPORT_PROGRAMS] if programs else [sys.executable]
    out = subprocess.run(
        [*head, str(EXAMPLES / f"{name}.py"), "--device", device, "--steps", str(steps), *EXTRA.get(name, []), *extra],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    values = [float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", out.stdout, re.M)]
    assert len(values) == steps, out.stdout
    printed = next((line[9:] for line in out.stdout.splitlines() if line.startswith("PROGRAMS ")), "")
    return values, printed


# Several runs in one Python process (one start-up of Python, torch and JAX for all), each as `python SCRIPT ARGS`
# would run it (runpy as __main__, sys.argv set, the script's folder first on sys.path), its stdout captured alone;
# printed as one JSON list at the end.
RUN_EACH = """\
import contextlib, io, json, os, runpy, sys
printed = []
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(argv[0], run_name="__main__")
    sys.path.pop(0)
    printed.append(out.getvalue())
print(json.dumps(printed))
"""


def run_each(runs: list[list[str]], cwd: Path | None = None, timeout: float = 600) -> list[str]:
    """Each run's stdout (a run is a script and its arguments), the runs one after the other in one process."""
    out = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(runs)], capture_output=True, text=True,
                         timeout=timeout, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def losses_on(names: list[str], devices: tuple[str, ...]) -> dict[str, dict[str, list[float]]]:
    """Each example's per-step losses on each device, as `losses(name, device)` gives them: device -> name ->
    losses. Every run not cached is made in one process (one start-up of Python, torch and JAX); on the CPU, those
    another test already ran come from the shared cache, and the rest go to it."""
    found: dict[str, dict[str, list[float]]] = {device: {} for device in devices}
    if "cpu" in devices:
        for name in names:
            cached = _cpu_cache() / f"{name}-plain.json"
            if cached.exists():
                found["cpu"][name] = json.loads(cached.read_text())
    todo = [(name, device) for device in devices for name in names if name not in found[device]]
    runs = [[str(EXAMPLES / f"{name}.py"), "--device", device, "--steps", str(STEPS_FOR.get(name, STEPS)),
             *EXTRA.get(name, [])] for name, device in todo]
    for (name, device), printed in zip(todo, run_each(runs) if runs else []):
        values = [float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", printed, re.M)]
        assert len(values) == STEPS_FOR.get(name, STEPS), (name, device, printed)
        found[device][name] = values
        if device == "cpu":
            cached = _cpu_cache() / f"{name}-plain.json"
            partial = cached.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps(values))
            partial.replace(cached)  # whole or not at all: another worker may be reading
    return found
