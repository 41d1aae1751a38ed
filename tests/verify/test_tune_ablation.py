"""The ablation of a verified plan: what each group of actions adds, and a slowing group left out."""

from __future__ import annotations

import random

from rich.console import Console

from tpu_agent.config import TuneOptions as TuneSettings
from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, PadOps, Plan
from tpu_agent.report import markdown as report
from tpu_agent.search.measure import interleave as _interleave
from tpu_agent.search.trials import StepRecord
from tpu_agent.verify.ablation import GROUPS, settle
from tpu_agent.verify.verdict import verify

# Step time factor of each group of actions on a 10 ms baseline step.
FACTORS = {"padding": 0.8, "execution": 0.9, "precision": 1.2}
PAD = PadDim(file="t.py", line=3, column=8, old=63, new=64, name="WIDTH")


def step_time(plan: Plan, rng: random.Random) -> float:
    t = 0.010
    for group in {GROUPS[a.kind] for a in plan.actions}:
        t *= FACTORS[group]
    return t * rng.uniform(0.98, 1.02)


class _Proc:
    def __init__(self, plan, rng):
        self.plan, self.rng, self.steps = plan, rng, []

    def step(self):
        record = StepRecord(step=len(self.steps) + 1, wall_s=step_time(self.plan, self.rng), loss=2.0)
        self.steps.append(record)
        return record


class FakeRunner:
    """Runner's interface, with step times from FACTORS instead of processes."""

    def __init__(self):
        self.rng = random.Random(0)
        self.verifications = 0
        self.last_baseline_steps: list[StepRecord] = []
        self.measured: list[tuple[str, ...]] = []

    def measure(self, plan, name, pairs, report=None, fresh_baseline=False):
        base, cand = _Proc(Plan(), self.rng), _Proc(plan, self.rng)
        a, b = _interleave(base.step, cand.step, pairs, report)
        self.last_baseline_steps = base.steps
        self.measured.append(("verify", *sorted(GROUPS[x.kind] for x in plan.actions)))
        return a, b, cand

    def measure_plans(self, without, plan, name, pairs):
        self.measured.append((name,))
        return _interleave(_Proc(without, self.rng).step, _Proc(plan, self.rng).step, pairs)

    def close(self):
        pass


def test_a_slowing_group_is_left_out_and_the_smaller_plan_verified():
    settings = TuneSettings(seed=0)
    plan = Plan(actions=[PAD, PadOps(multiple=8), Compile(mode="fused"), MatmulPrecision(precision="default")])
    runner, verdicts = FakeRunner(), []
    first = verify(plan, runner, settings, None)
    assert first.accepted  # 0.8 * 0.9 * 1.2 = 0.864 of the baseline's time
    best = settle(first, runner, settings, None, None, Console(quiet=True), verdicts)

    assert best is not first and best.accepted
    assert best.plan == Plan(actions=[PAD, PadOps(multiple=8), Compile(mode="fused")])
    assert best.speed.speedup > first.speed.speedup
    assert len(best.left_out) == 1 and best.left_out[0].startswith("precision (matmul_precision")
    # The first plan's ablation measured three groups; the smaller plan's, two, none of them slowing.
    added = {a.group: a.speed.speedup for a in best.attribution}
    assert set(added) == {"padding", "execution"}
    assert abs(added["padding"] - 1 / 0.8) < 0.05 and abs(added["execution"] - 1 / 0.9) < 0.05
    assert [m[0] for m in runner.measured] == ["verify", "ablate-padding", "ablate-execution", "ablate-precision",
                                               "verify", "ablate-padding", "ablate-execution"]
    assert verdicts == [best]

    text = report.markdown(_result(best, verdicts), {})
    assert "Left out of the search's best plan:* precision" in text and "Where the gain comes from" in text


def test_a_single_group_plan_is_not_ablated():
    runner = FakeRunner()
    verdict = verify(Plan(actions=[PAD]), runner, TuneSettings(seed=0), None)
    best = settle(verdict, runner, TuneSettings(seed=0), None, None, Console(quiet=True), [])
    assert best is verdict and best.attribution == [] and best.left_out == []


def _result(best, verdicts):
    from tpu_agent.report.result import TuneResult

    return TuneResult(script="t.py", args=[], settings=TuneSettings(), study="s", storage="sqlite://", run_dir=".",
                      best=best, verdicts=[best, *verdicts])
