"""The example scripts train on the tpu device with the CPU's per-step losses."""

from __future__ import annotations

import pytest

from support.examples import losses


@pytest.mark.parametrize("name", ["mlp", "odd_shapes", "cnn", "transformer"])
def test_example_matches_cpu_in_eager_mode(name):
    cpu = losses(name, "cpu")
    tpu = losses(name, "tpu")
    for step, (a, b) in enumerate(zip(cpu, tpu)):
        assert b == pytest.approx(a, rel=1e-4), f"step {step}: cpu {a} tpu {b}"
