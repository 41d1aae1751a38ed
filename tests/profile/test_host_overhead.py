"""Host overhead vs device time (profile.host_device): measured on steps whose every launch is waited for.

One real run (a tiny model in eager mode: many small ops, clearly host-bound even on a loaded 2-core CPU)
checks the flow and that the numbers add up; the split's arithmetic, the terminal line and the playbook
are checked on hand-built profiles, with no timing in them.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from support.fake_profiles import make_profile
from support.processes import clean_env, run_tool
from tpu_agent.cli.profile_view import render_to_text
from tpu_agent.profilers import analysis
from tpu_agent.profilers.schema import Estimate, HostDevice, Profile, Step, Target
from tpu_agent.propose.offline import propose_offline

TINY = """\
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8).to("tpu")
    for i in range({steps}):
        opt.zero_grad()
        h = model(x)
        for _ in range(8):
            h = h * 0.5 + h.tanh()
        h.square().mean().backward()
        opt.step()
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A peak calibration in a private cache, measured once in this process (not in each child)."""
    import jax

    from tpu_agent.profilers import peaks

    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TPU_AGENT_CACHE_DIR")
    os.environ["TPU_AGENT_CACHE_DIR"] = str(path)
    try:
        peaks.device_peak(jax.devices()[0].platform, jax.devices()[0].device_kind, 1)
    finally:
        if old is None:
            del os.environ["TPU_AGENT_CACHE_DIR"]
        else:
            os.environ["TPU_AGENT_CACHE_DIR"] = old
    return path


def _profile(tmp_path: Path, cache: Path, *args: str, steps: int = 10) -> tuple[Profile, str]:
    (tmp_path / "tiny.py").write_text(textwrap.dedent(TINY.format(steps=steps)))
    proc = run_tool("profile", "tiny.py", "--mode", "eager", "--json", *args, cwd=tmp_path,
                    env=clean_env(TPU_AGENT_CACHE_DIR=str(cache)), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Profile.model_validate_json(proc.stdout), proc.stderr


def test_tiny_eager_model_is_host_bound_and_the_numbers_add_up(tmp_path, cache_dir):
    prof, _ = _profile(tmp_path, cache_dir, "--steps", "3")
    items = prof.steps.items
    # --steps 3 keeps 3 measured steps: the 2 timed steps come after them, left out of the statistics.
    assert [s.index for s in items] == list(range(1, 8)) and prof.status == "stopped"
    timed = [s for s in items if s.device_s is not None]
    assert [s.index for s in timed] == [6, 7] and all(s.instrumented and s.launches > 10 for s in timed)
    assert prof.steps.stats.count <= 3 and "instrumented" in prof.steps.stats.basis
    h = prof.host_device
    assert h is not None and h.steps == [s.index for s in timed if not s.compiled] and h.steps
    used = [s for s in timed if s.index in h.steps]
    assert h.wall_s == pytest.approx(sum(s.wall_s for s in used) / len(used))
    assert h.host_s + h.device_s == pytest.approx(h.wall_s)
    assert h.host_share + h.device_share == pytest.approx(1.0)
    assert 0 < h.device_s < h.wall_s and "waited for" in h.method
    # The clear-cut case: tens of tiny ops, microseconds each on the device, tens of microseconds in Python.
    assert h.host_share > 0.5 and h.bound == "host" and not h.bound_estimate, h
    assert any("steps 6-7 waited for every executable launch" in n for n in prof.notes)
    line = next(ln for ln in render_to_text(prof).splitlines() if "host/device" in ln)
    assert f"host-bound: {h.host_share * 100:.0f} % of the step is host overhead (dispatch and tracing), " \
           f"{h.device_share * 100:.0f} % device time" in line


def test_without_steps_the_first_steps_after_warmup_are_timed(tmp_path, cache_dir):
    prof, _ = _profile(tmp_path, cache_dir, "--host-device-steps", "1", steps=5)
    assert prof.status == "complete" and len(prof.steps.items) == 5
    assert [s.index for s in prof.steps.items if s.device_s is not None] == [3]
    assert prof.steps.stats.count <= 2 and prof.host_device is not None
    assert any("the first after warm-up" in n for n in prof.notes)


def _steps(*rows):
    """(wall, device, compiled) per step after a 1-step warm-up."""
    out = [Step(index=1, wall_s=1.0, warmup=True, device_s=0.1)]
    for i, (wall, device, compiled) in enumerate(rows, start=2):
        out.append(Step(index=i, wall_s=wall, device_s=device, compiled=compiled, instrumented=device is not None,
                        launches=None if device is None else 40))
    return out


def _roofline(bound: str) -> Target:
    e = Estimate(value=1e-3, unit="s", basis="test")
    return Target(generation="v5e", peak_flops_per_s=1.97e14, hbm_bandwidth=8.2e11, source="test", step_s=e,
                  compute_s=Estimate(value=1e-4 if bound == "memory" else 1e-3, unit="s", basis="test"),
                  memory_s=Estimate(value=1e-3 if bound == "memory" else 1e-4, unit="s", basis="test"), bound=bound,
                  mfu=Estimate(value=0.1, unit="fraction", basis="test"))


def test_split_uses_timed_compile_free_steps_and_classifies():
    # Warm-up, untimed and compiling steps are left out: steps 4 and 5 only.
    steps = _steps((0.5, None, False), (0.9, 0.1, True), (0.010, 0.002, False), (0.012, 0.001, False))
    h = analysis.host_device(steps, 1e6, 1e12, None)
    assert h.steps == [4, 5] and h.wall_s == pytest.approx(0.011) and h.device_s == pytest.approx(0.0015)
    assert h.host_s == pytest.approx(0.0095) and h.bound == "host" and h.launches_per_step == 40
    assert analysis.host_device(_steps((0.5, None, False)), 1e6, 1e12, None) is None
    device_bound = _steps((0.010, 0.009, False))
    # FLOPs at the peak fill 90 % of the device time: compute-bound, measured.
    h = analysis.host_device(device_bound, 0.9 * 0.009 * 1e12, 1e12, _roofline("memory"))
    assert h.bound == "compute" and not h.bound_estimate and h.device_flop_utilization == pytest.approx(0.9)
    # Few FLOPs for the time: the roofline of the target TPU says memory (an estimate, said so).
    h = analysis.host_device(device_bound, 1e6, 1e12, _roofline("memory"))
    assert h.bound == "memory" and h.bound_estimate and "estimate" in h.bound_basis
    assert analysis.host_device(device_bound, 1e6, 1e12, _roofline("compute")).bound == "device"


def _host_bound(share: float) -> Profile:
    prof = make_profile()
    wall = 0.010
    prof.host_device = HostDevice(
        steps=[8, 9], wall_s=wall, device_s=wall * (1 - share), host_s=wall * share, host_share=share,
        device_share=1 - share, launches_per_step=30, bound="host" if share > 0.5 else "device",
        bound_basis="test", method="test")
    prof.mode_used = "eager"
    return Profile.model_validate_json(prof.model_dump_json())  # and it round-trips


def test_terminal_line_and_old_profiles_load():
    text = render_to_text(_host_bound(0.87))
    assert ("host-bound: 87 % of the step is host overhead (dispatch and tracing), 13 % device time "
            "(measured on steps 8-9, every launch waited for") in text
    old = make_profile().model_dump(mode="json")
    del old["host_device"]
    assert Profile.model_validate(old).host_device is None
    assert "host/device" not in render_to_text(Profile.model_validate(old))


def test_host_bound_profile_ranks_taking_python_off_the_step_first():
    ranked = propose_offline(_host_bound(0.87)).candidates
    top = ranked[0]
    assert top.playbook == "host-bound-step" and "compiled-step" in top.also_playbooks
    assert top.actions[0].choices == {"mode": ["fused", "compiled"]}
    assert "host_share = 0.87" in top.reason and top.score == pytest.approx(0.87 * 0.8)
    # Device-bound, or not measured: the playbook stays out; compiled-step still proposes the compile.
    for prof in (_host_bound(0.3), make_profile()):
        result = propose_offline(prof)
        assert not any(c.playbook == "host-bound-step" for c in result.candidates)
        assert any(c.playbook == "compiled-step" for c in result.candidates)
