"""Running an example script as a user would, and reading its per-step losses."""

from __future__ import annotations

import re
import subprocess
import sys

from support.paths import EXAMPLES

STEPS = 20
# The transformer's LM head (50257 columns) is ~10 GFLOP a step: two passes over its 4 batches.
STEPS_FOR = {"transformer": 8}
# Dropout masks come from each device's own RNG stream: compare with dropout off.
EXTRA = {"cnn": ["--dropout", "0"]}


def losses(name: str, device: str, *extra: str) -> list[float]:
    steps = STEPS_FOR.get(name, STEPS)
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--device", device, "--steps", str(steps), *EXTRA.get(name, []), *extra],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    values = [float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", out.stdout, re.M)]
    assert len(values) == steps, out.stdout
    return values
