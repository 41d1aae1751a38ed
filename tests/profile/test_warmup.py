"""The warm-up section (profile.warmup), as TorchTPU reports its benchmarks: one real run for the flow, the
arithmetic on hand-built steps (no timing in the assertions)."""

from __future__ import annotations

import textwrap

import pytest

from support.fake_profiles import make_profile
from support.processes import clean_env, run_tool
from tpu_agent.cli.diff import compare
from tpu_agent.cli.profile_view import render_to_text
from tpu_agent.profilers import warmup
from tpu_agent.profilers.schema import Memory, Profile, Step, Steps
from tpu_agent.report.summary import from_profile

SCRIPT = """\
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16).to("tpu")
    kept = []
    for i in range(40):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if {leak}:
            kept.append(torch.randn(64, 1024).to("tpu"))  # 256 KiB kept on the device every step
"""


def _profile(tmp_path, leak: bool) -> Profile:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT.format(leak=leak)))
    proc = run_tool("profile", "train.py", "--json", "--no-dump-hlo", cwd=tmp_path, env=clean_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Profile.model_validate_json(proc.stdout)


def test_a_real_run_reports_first_step_warmup_steady_step_and_flat_memory(tmp_path):
    prof = _profile(tmp_path, leak=False)
    w = prof.warmup
    compiled = [st.index for st in prof.steps.items if st.compiled]
    assert compiled and w.compiling_steps == max(compiled) < 40
    assert w.first_step_s == prof.steps.items[0].wall_s
    assert w.first_step_instrumented  # the profiler's FLOP cross-check runs in step 1
    # The profiler's host/device steps (every launch waited for) are not steady steps.
    assert w.steady_steps == sum(1 for st in prof.steps.items if st.index > w.compiling_steps and not st.instrumented)
    assert 30 <= w.steady_steps < 40
    assert w.programs_compiled == prof.steps.compiles >= 1
    assert w.peak_bytes and w.memory_flat is True
    text = render_to_text(prof)
    assert "warm-up" in text and f"compiling stopped after step {w.compiling_steps}" in text and "flat" in text


def test_memory_kept_every_step_reads_as_growth(tmp_path):
    w = _profile(tmp_path, leak=True).warmup
    assert w.memory_flat is False
    assert w.live_growth_bytes_per_step == pytest.approx(64 * 1024 * 4, rel=0.05)


def _steps(*rows) -> Steps:
    items = [Step(index=i + 1, wall_s=wall, compiled=compiled, live_bytes=live)
             for i, (wall, compiled, live) in enumerate(rows)]
    return Steps(markers=["optimizer"], items=items, compiles=3)


def test_arithmetic_where_compiling_stops_after_the_fixed_warmup():
    # Steps 1 and 3 compile (a new shape at step 3): warm-up is steps 1-3, steady is steps 4-6.
    steps = _steps((2.0, True, 100), (0.1, False, 100), (0.5, True, 100), (0.1, False, 100), (0.12, False, 100),
                   (0.08, False, 100))
    w = warmup.summarize(steps, Memory(live_peak_bytes=100))
    assert (w.compiling_steps, w.steady_steps) == (3, 3)
    assert w.warmup_s == pytest.approx(2.6) and w.steady_step_s == pytest.approx(0.1)
    assert w.overhead_s == pytest.approx(2.6 - 3 * 0.1)
    assert (w.peak_bytes, w.memory_flat, w.live_growth_bytes_per_step) == (100, True, 0)


def test_a_sawtooth_the_cycle_collector_frees_is_flat_and_a_rising_floor_is_not():
    # Live bytes of examples/fsdp2.py's fused steps at 2 ranks (rank 0, 2026-12-05): cyclic garbage piles up for
    # a few steps and is freed back to the same floor. A least-squares slope read +1.65 KiB per step: "GROWS".
    saw = [776708, 846644, 882132, 776708, 778788, 814276, 849764, 885252, 920740, 776708, 778788, 878500,
           1011620, 1144740, 1211556, 1211556, 1211556, 776708, 776708, 776708, 776708, 776708, 776708]
    w = warmup.summarize(_steps((2.0, True, saw[0]), *((0.1, False, b) for b in saw)), Memory(live_peak_bytes=1))
    assert (w.memory_flat, w.live_growth_bytes_per_step) == (True, 0)
    # The same teeth on a floor that rises 4 KiB a step: a leak under the noise.
    leak = [b + 4096 * i for i, b in enumerate(saw)]
    w = warmup.summarize(_steps((2.0, True, leak[0]), *((0.1, False, b) for b in leak)), Memory(live_peak_bytes=1))
    assert w.memory_flat is False and w.live_growth_bytes_per_step > 1024


def test_runtime_peak_is_preferred_and_a_last_compiling_step_leaves_no_steady_step():
    w = warmup.summarize(_steps((1.0, True, 10), (0.5, True, 10)),
                         Memory(live_peak_bytes=10, device_stats={"peak_bytes_in_use": 99}))
    assert (w.peak_bytes, w.steady_step_s, w.overhead_s, w.memory_flat) == (99, None, None, None)
    assert "runtime" in w.peak_source
    assert warmup.summarize(Steps(markers=[], whole_run=True, items=[Step(index=1, wall_s=1.0)]), Memory()) is None


def test_diff_shows_the_warmup_without_gating_it():
    base, head = make_profile(), make_profile()
    base.warmup = warmup.summarize(_steps((3.0, True, 1), (0.1, False, 1), (0.1, False, 1), (0.1, False, 1)),
                                   Memory())
    head.warmup = warmup.summarize(_steps((6.0, True, 1), (0.1, False, 1), (0.1, False, 1), (0.1, False, 1)),
                                   Memory())
    rows = {r.metric.field: r for r in compare(from_profile(base), from_profile(head), fail_above=5)}
    assert rows["first_step_s"].verdict == "worse" and not rows["first_step_s"].regression
    assert rows["warmup_overhead_s"].change == pytest.approx((5.9 / 2.9) - 1)
