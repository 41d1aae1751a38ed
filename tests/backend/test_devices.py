"""One process over all its local devices: `tpu:k` is local JAX device k (two simulated CPU devices here).

JAX reads the device count when it starts, so the checks run in one child process with `TPU_AGENT_DEVICES=2`
and report back as JSON; each test asserts one part of it. References are PyTorch's own CPU results."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r"""
    import json, torch
    from torch import nn

    out = {}
    def devices(t):
        return sorted(d.id for d in t.jax().devices())

    out["count"] = [torch.tpu.device_count(), torch.accelerator.device_count()]

    def train(device, mode=None, steps=4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        x, y = x.to(device), y.to(device)
        losses = []
        def loop():
            for _ in range(steps):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        if mode == "fused":
            with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
                loop()
        elif mode == "compiled":
            torch.tpu.compile_steps(True)
            try:
                loop()
            finally:
                torch.tpu.compile_steps(False)
        else:
            loop()
        params = [p for p in model.parameters()]
        done = {"losses": losses, "param_devices": sorted({str(p.device) for p in params}),
                "weight": params[0].detach().cpu().flatten()[:8].tolist()}
        if device != "cpu":
            done["array_devices"] = sorted({i for p in params for i in devices(p)})
            done["grad_devices"] = sorted({i for p in params for i in devices(p.grad)})
        return done

    out["cpu"] = train("cpu")
    for mode in ("eager", "fused", "compiled"):
        out[mode] = train("tpu:1", mode)

    a = torch.arange(6.0).reshape(2, 3).to("tpu:1")
    b = a.to("tpu:0")  # a cross-device copy
    c = torch.empty(2, 3, device="tpu:1").copy_(b * 2)  # copy_ from tpu:0 into tpu:1
    out["copy"] = {"a": [str(a.device), devices(a)], "b": [str(b.device), devices(b), b.cpu().tolist()],
                   "c": [str(c.device), devices(c), c.cpu().tolist()]}
    try:
        a + b
        out["mixed"] = None
    except RuntimeError as exc:
        out["mixed"] = str(exc)
    try:
        torch.zeros(2, device="tpu:2")
        out["ordinal"] = None
    except RuntimeError as exc:
        out["ordinal"] = str(exc)
    p0, p1 = torch.arange(4.0).to("tpu:0"), torch.arange(4.0).to("tpu:1")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):  # work pending on both devices at once
        q0, q1 = p0 * 2 + 1, p1 * 3 + 1
        out["fused_two"] = [q0.cpu().tolist(), devices(q0), q1.cpu().tolist(), devices(q1)]
    z = torch.zeros(2, 2, device="tpu:1")
    out["factory"] = [str(z.device), devices(z), str(torch.ones(3, device="tpu:0").device)]
    torch.accelerator.set_device_index(1)
    current = torch.zeros(2, device="tpu")
    moved, layer = torch.randn(2).to("tpu"), nn.Linear(2, 2).to(torch.device("tpu"))
    out["current"] = [torch.accelerator.current_device_index(), torch.tpu.current_device(), str(current.device),
                      devices(current), str(moved.device), devices(moved), str(layer.weight.device)]
    torch.tpu.set_device(0)
    print("RESULT" + json.dumps(out))
""")


@functools.lru_cache(maxsize=None)
def _child() -> dict:
    """The child's report, once per test process. Not a module fixture's alone: the suite runs its tests longest
    first across modules (tests/support/durations.py), and pytest tears a module fixture down and sets it up
    again each time the order comes back to the module, which started this child once per test."""
    env = {**os.environ, "TPU_AGENT_DEVICES": "2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.fixture
def result():
    return _child()


def test_device_count(result):
    assert result["count"] == [2, 2]


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_training_on_tpu1_matches_cpu(result, mode):
    run, cpu = result[mode], result["cpu"]
    assert run["losses"] == pytest.approx(cpu["losses"], rel=1e-5, abs=1e-6)
    assert run["weight"] == pytest.approx(cpu["weight"], rel=1e-5, abs=1e-6)
    assert run["param_devices"] == ["tpu:1"]
    assert run["array_devices"] == [1] and run["grad_devices"] == [1]  # the arrays themselves on device 1


def test_cross_device_copies(result):
    copy = result["copy"]
    assert copy["a"] == ["tpu:1", [1]]
    assert copy["b"] == ["tpu:0", [0], [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]]
    assert copy["c"] == ["tpu:1", [1], [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]]


def test_fused_work_on_two_devices_stays_on_each(result):
    assert result["fused_two"] == [[1.0, 3.0, 5.0, 7.0], [0], [1.0, 4.0, 7.0, 10.0], [1]]


def test_mixed_devices_is_an_error_naming_both(result):
    assert result["mixed"] is not None
    assert "tpu:0" in result["mixed"] and "tpu:1" in result["mixed"] and "same device" in result["mixed"]


def test_invalid_ordinal(result):
    assert "invalid device ordinal 2" in result["ordinal"]


def test_factories_and_current_device(result):
    assert result["factory"] == ["tpu:1", [1], "tpu:0"]
    assert result["current"] == [1, 1, "tpu:1", [1], "tpu:1", [1], "tpu:1"]  # "tpu" is the current device
