"""The example scripts train on the tpu device with the CPU's per-step losses."""

from __future__ import annotations

import json
import os
import re

import pytest

from support.examples import EXTRA, STEPS, STEPS_FOR, _cpu_cache, losses_of, run_each
from support.paths import EXAMPLES

NAMES = ["mlp", "odd_shapes", "cnn", "transformer"]


def _losses_on_cpu_and_tpu(names: list[str]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each example's per-step losses on the CPU and on tpu, as `losses_of` gives them, every run in one process
    (one start-up of Python, torch and JAX): the CPU's from the run's shared cache where another test already ran
    them, the rest run first and written to it."""
    cpu = losses_of([n for n in names if (_cpu_cache() / f"{n}-plain.json").exists()], "cpu")
    todo = [n for n in names if n not in cpu]
    runs = [(name, device) for device in ("cpu", "tpu") for name in (todo if device == "cpu" else names)]
    printed = run_each([[str(EXAMPLES / f"{name}.py"), "--device", device, "--steps", str(STEPS_FOR.get(name, STEPS)),
                         *EXTRA.get(name, [])] for name, device in runs])
    tpu = {}
    for (name, device), out in zip(runs, printed):
        values = [float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", out, re.M)]
        assert len(values) == STEPS_FOR.get(name, STEPS), (name, device, out)
        (cpu if device == "cpu" else tpu)[name] = values
        if device == "cpu":
            cached = _cpu_cache() / f"{name}-plain.json"
            partial = cached.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps(values))
            partial.replace(cached)  # whole or not at all: another worker may be reading
    return cpu, tpu


def test_every_example_matches_cpu_in_eager_mode():
    """Each example in eager mode, its losses step by step within 1e-4 of the CPU's (the CPU runs and the tpu
    runs one after the other in one process: one start-up of Python, torch and JAX)."""
    cpu, tpu = _losses_on_cpu_and_tpu(NAMES)
    for name in NAMES:
        assert len(tpu[name]) == len(cpu[name]) > 0, name
        for step, (a, b) in enumerate(zip(cpu[name], tpu[name])):
            assert b == pytest.approx(a, rel=1e-4), f"{name} step {step}: cpu {a} tpu {b}"
