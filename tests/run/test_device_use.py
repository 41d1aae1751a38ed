"""A run that used the device is never called one that did not: device use is told by the ops dispatched to it,
not by training steps or by the programs that ran."""

from __future__ import annotations

import json
from types import SimpleNamespace

from support.processes import run_tool
from tpu_agent.run.device_use import profile_touched

NOISY = """\
import torch
for i in range(3000):
    print(f"line {i}")
a = torch.randn(64, 64).to("tpu")
b = torch.randn(64, 64).to("tpu")
c = a @ b
"""


def _profile(device_ops=None, h2d=0, calls=0):
    return SimpleNamespace(device_ops=device_ops, transfers=SimpleNamespace(h2d_count=h2d), flops=None,
                           executables=[SimpleNamespace(calls=calls)] if calls else [])


def test_device_use_is_told_by_the_ops_dispatched():
    assert profile_touched(_profile(device_ops=3))  # ops dispatched, no program ran (fused, nothing read back)
    assert profile_touched(_profile(h2d=2))  # tensors copied to the device
    assert profile_touched(_profile(calls=1))  # a profile written before the counter: a program ran
    assert not profile_touched(_profile(device_ops=0))  # a run that trained on the CPU


def test_profile_of_a_noisy_script_with_one_matmul_and_no_step(tmp_path):
    (tmp_path / "noisy.py").write_text(NOISY)
    proc = run_tool("profile", "noisy.py", "--warmup", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ran on the tpu device" not in proc.stderr + proc.stdout
    assert "op(s) reached the tpu device but no program ran them" in proc.stdout
    assert "both count the same matmuls" not in proc.stdout  # XLA's 0 FLOP: no program ran, not the same count
    assert "no XLA program that ran in this region did the matmuls" in proc.stdout
    (run_dir,) = (tmp_path / ".tpu-agent" / "runs").iterdir()
    prof = json.loads((run_dir / "profile.json").read_text())
    assert prof["device_ops"] >= 1 and prof["transfers"]["h2d_count"] == 2
