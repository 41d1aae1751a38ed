"""NaN and infinite losses (issue #27): no comparison lets them through, a baseline that produces one stops the
tune, a candidate that produces one fails its trial with that reason. At the first step and at a later one."""

from __future__ import annotations

import math
import textwrap

import pytest

from support.processes import run_tool
from tpu_agent.config import TuneOptions
from tpu_agent.measure.numerics import check_exact, check_loss_tol
from tpu_agent.measure.runner import BaselineNotFinite, Runner
from tpu_agent.measure.trials import StepRecord, TrialFailed
from tpu_agent.plan.actions import Plan

NAN, INF = math.nan, math.inf
GOOD = [2.0, 1.9, 1.8, 1.7, 1.6]


def _with(value, at):
    losses = list(GOOD)
    losses[at] = value
    return losses


@pytest.mark.parametrize("check", [check_exact, check_loss_tol])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("at", [0, 3])
def test_no_check_passes_a_loss_that_is_not_a_number(check, value, at):
    both = check(_with(value, at), _with(value, at))  # the same NaN on both sides is two diverged runs
    assert not both.passed and "not finite" in both.reason and f"step {at}" in both.reason
    candidate = check(GOOD, _with(value, at))
    assert not candidate.passed and "candidate's loss is not finite" in candidate.reason
    baseline = check(_with(value, at), GOOD)
    assert not baseline.passed and "baseline's loss is not finite" in baseline.reason
    assert check(GOOD, GOOD).passed


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_step_record_carries_a_loss_that_is_not_a_number_across_the_pipe(value):
    from tpu_agent.run.messages import TRIAL_MESSAGE

    back = TRIAL_MESSAGE.validate_json(StepRecord(step=4, wall_s=0.1, loss=value).model_dump_json())
    assert back.loss is not None and (math.isnan(back.loss) if math.isnan(value) else back.loss == value)


class FakeProcess:
    """A trial process whose step `bad_at` reports `value` as its loss."""

    def __init__(self, name, bad_at=None, value=NAN):
        self.name, self.bad_at, self.value = name, bad_at, value
        self.steps, self.notes, self.proc, self.warm_s = [], [], None, None
        self.log_dir = None

    def start(self):
        self.proc = self

    def poll(self):
        return None

    def step(self):
        n = len(self.steps)
        record = StepRecord(step=n, wall_s=0.01, loss=self.value if n == self.bad_at else 1.0 / (n + 1),
                            device_bytes=0)
        self.steps.append(record)
        return record

    def stop(self):
        pass


def _runner(tmp_path, baseline_bad=None, candidate_bad=None):
    runner = Runner(tmp_path / "train.py", [], TuneOptions(steps=6, warmup=2), tmp_path)

    def process(plan, name):
        bad = baseline_bad if name.startswith("baseline") else candidate_bad
        proc = FakeProcess(name, bad)
        proc.log_dir = tmp_path
        return proc

    runner.process = process
    return runner


@pytest.mark.parametrize("at", [0, 4])  # in the warm-up, and in a measured pair
def test_a_baseline_that_is_not_finite_stops_the_tune_naming_the_step(tmp_path, at):
    with pytest.raises(BaselineNotFinite, match=f"loss is nan at step {at}"):
        _runner(tmp_path, baseline_bad=at).measure(Plan(), "trial-0", 6)


@pytest.mark.parametrize("at", [1, 5])
def test_a_candidate_that_goes_not_finite_fails_its_trial_with_that_reason(tmp_path, at):
    with pytest.raises(TrialFailed) as failed:
        _runner(tmp_path, candidate_bad=at).measure(Plan(), "trial-0", 6)
    assert failed.value.kind == "not_finite" and f"step {at}" in failed.value.message
    with pytest.raises(TrialFailed, match="not_finite"):  # a verification's processes too
        _runner(tmp_path, candidate_bad=at).measure_plans(Plan(), Plan(), "verify-0")


DIVERGES = """\
    import torch
    model = torch.nn.Linear(8, 4).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8).to("tpu")
    for i in range(40):
        opt.zero_grad()
        loss = model(x).square().mean() * (float("nan") if i >= 3 else 1.0)
        loss.backward()
        opt.step()
"""


@pytest.mark.slow  # a baseline profile and one baseline process
def test_a_tune_of_a_script_whose_loss_is_nan_stops_with_one_line(tmp_path):
    """--warmup 4: the NaN comes in the baseline's warm-up, so the tune stops before any candidate process starts
    (with 2, a candidate started and warmed for nothing: 14.3 s -> 7.7 s). A NaN in a measured pair stops the
    tune the same way: test_a_baseline_that_is_not_finite_stops_the_tune_naming_the_step[4] above."""
    (tmp_path / "diverges.py").write_text(textwrap.dedent(DIVERGES))
    proc = run_tool("tune", "diverges.py", "--trials", "2", "--steps", "5", "--pairs", "5", "--warmup", "4",
                    "--offline", cwd=tmp_path, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # the child counts steps from 1
    assert len(errors) == 1 and "the unchanged script's loss is nan at step 4" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "verified" not in proc.stdout
    (run_dir,) = (tmp_path / ".tpu-agent" / "runs").iterdir()
    assert [p.name for p in (run_dir / "logs").iterdir()] == ["baseline-1.log"]  # no candidate process started
