"""The example scripts train on the tpu device with the CPU's per-step losses."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from support.paths import EXAMPLES

STEPS = 20
# Dropout masks come from each device's own RNG stream: compare with dropout off.
EXTRA = {"cnn": ["--dropout", "0"]}


def losses(name: str, device: str, *extra: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--device", device, "--steps", str(STEPS), *EXTRA.get(name, []), *extra],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    values = [float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", out.stdout, re.M)]
    assert len(values) == STEPS, out.stdout
    return values


@pytest.mark.parametrize("name", ["mlp", "odd_shapes", "cnn", "transformer"])
def test_example_matches_cpu_in_eager_mode(name):
    cpu = losses(name, "cpu")
    tpu = losses(name, "tpu")
    for step, (a, b) in enumerate(zip(cpu, tpu)):
        assert b == pytest.approx(a, rel=1e-4), f"step {step}: cpu {a} tpu {b}"
