"""The ablation of a verified plan: what each group of actions adds, and a slowing group left out."""

from __future__ import annotations

from rich.console import Console

from support.fake_runner import FakeRunner
from tpu_agent.config import TuneOptions as TuneSettings
from tpu_agent.plan.actions import Compile, MatmulPrecision, PadDim, PadOps, Plan
from tpu_agent.report import markdown as report
from tpu_agent.verify.ablation import settle
from tpu_agent.verify.verdict import verify

PAD = PadDim(file="t.py", line=3, column=8, old=63, new=64, name="WIDTH")


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
    assert [m[0] for m in runner.measured] == ["verify-1", "ablate-padding", "ablate-execution", "ablate-precision",
                                               "verify-2", "ablate-padding", "ablate-execution"]
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
