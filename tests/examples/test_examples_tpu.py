"""The example scripts train on the tpu device with the CPU's per-step losses."""

from __future__ import annotations

import pytest

from support.examples import losses_on

NAMES = ["mlp", "odd_shapes", "cnn", "transformer"]


def test_every_example_matches_cpu_in_eager_mode():
    """Each example in eager mode, its losses step by step within 1e-4 of the CPU's (the CPU runs and the tpu
    runs one after the other in one process: one start-up of Python, torch and JAX)."""
    found = losses_on(NAMES, ("cpu", "tpu"))
    cpu, tpu = found["cpu"], found["tpu"]
    for name in NAMES:
        assert len(tpu[name]) == len(cpu[name]) > 0, name
        for step, (a, b) in enumerate(zip(cpu[name], tpu[name])):
            assert b == pytest.approx(a, rel=1e-4), f"{name} step {step}: cpu {a} tpu {b}"
