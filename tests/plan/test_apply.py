"""A plan's run-time actions, applied before an unchanged script runs."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from support.paths import EXAMPLES

RUNNER = textwrap.dedent("""
    import json, os, runpy, sys
    import torch
    from tpu_agent.plan.actions import Plan
    from tpu_agent.plan.runtime import apply_runtime
    applied = apply_runtime(Plan.model_validate_json(sys.argv[1]))
    sys.argv = [sys.argv[2], "--steps", "5"]
    sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python SCRIPT` has it (examples/training.py)
    runpy.run_path(sys.argv[0], run_name="__main__")
    print("APPLIED", json.dumps({"notes": applied.notes, "sharded": applied.sharded, "model": applied.model}))
""")


def run(plan: dict, example: str = "mlp", devices: int | None = None):
    env = dict(os.environ)
    if devices:
        env["TPU_AGENT_DEVICES"] = str(devices)
    out = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(plan), str(EXAMPLES / f"{example}.py")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"^step=\d+ loss=(\S+)$", out.stdout, re.M)]
    applied = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("APPLIED"))[len("APPLIED"):])
    return losses, applied


@functools.cache
def _baseline() -> tuple[float, ...]:
    """The unchanged run's losses, run once per test run and shared by both workers (examples/mlp.py seeds
    everything: a rerun gives the same losses), as support/examples.py shares the CPU's."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    cached = Path(tempfile.gettempdir()) / f"tpu-agent-tests-apply-baseline-{run_id}.json"
    if not cached.exists():
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(run({"actions": []})[0]))
        partial.replace(cached)  # whole or not at all: the other worker may be reading
    return tuple(json.loads(cached.read_text()))


@pytest.fixture
def baseline():
    """Run once per test process: the suite's longest-first order leaves this module and comes back, and a
    module fixture was set up again at each return."""
    return list(_baseline())


@pytest.mark.parametrize("actions,devices,note", [
    ([{"kind": "pad_ops", "multiple": 128}], None, "padded to multiples of 128"),
    ([{"kind": "compile", "mode": "fused"}], None, "fused execution"),
    ([{"kind": "compile", "mode": "compiled"}], None, "forward and backward programs"),
    ([{"kind": "matmul_precision", "precision": "highest"}], None, "precision highest"),
    ([{"kind": "mesh", "axes": {"data": 2}}, {"kind": "batch_sharding", "axis": "data"},
      {"kind": "shard_rule", "pattern": "fc1.weight", "spec": ["data", None]}], 2, "mesh"),
], ids=["pad_ops", "fused", "compiled", "precision", "sharding"])
def test_runtime_actions_keep_the_losses(baseline, actions, devices, note):
    losses, applied = run({"actions": actions}, devices=devices)
    assert any(note in n for n in applied["notes"]), applied
    assert losses == pytest.approx(baseline, rel=1e-5)
    if devices:
        assert ["fc1.weight", ["data", None]] in applied["sharded"]
        assert applied["model"] == "MLP"
