"""The ablation of a verified plan: what each group of actions adds, and a slowing group left out."""

from __future__ import annotations

import io

from rich.console import Console

from support.fake_runner import FACTORS, FakeRunner
from tpu_agent.config import TuneOptions as TuneSettings
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.stats import speedup
from tpu_agent.plan.actions import ActivationCheckpointing, Compile, MatmulPrecision, PadDim, PadOps, Plan
from tpu_agent.report import markdown as report
from tpu_agent.report.console import TuneLines
from tpu_agent.verify import ablation
from tpu_agent.verify.ablation import settle
from tpu_agent.verify.verdict import Attribution, Verdict, verify

PAD = PadDim(file="t.py", line=3, column=8, old=63, new=64, name="WIDTH")


class Said:
    """The ablation's watcher as the tune's console has it (report.console.TuneLines); the verdicts kept."""

    def __init__(self) -> None:
        self.out, self.verdicts = io.StringIO(), []
        self.lines = TuneLines(Console(file=self.out, width=300))

    def unit_added(self, attribution) -> None:
        self.lines.unit_added(attribution)

    def trimming(self, smaller, without, left_out) -> None:
        self.lines.trimming(smaller, without, left_out)

    def verified(self, verdict) -> None:
        self.verdicts.append(verdict)
        self.lines.verdict(verdict)


def settled(plan: Plan, factors: dict[str, float] = FACTORS, said: Said | None = None):
    settings, runner, said = TuneSettings(seed=0), FakeRunner(factors=factors), said or Said()
    first = verify(plan, Measuring(runner, settings))
    assert first.accepted
    return first, settle(first, Measuring(runner, settings), said), runner, said.verdicts


def test_a_slowing_group_is_left_out_and_the_smaller_plan_verified():
    factors = {**FACTORS, "padding (model)": 0.85}
    plan = Plan(actions=[PAD, PadOps(multiple=8), Compile(mode="fused"), MatmulPrecision(precision="default")])
    said = Said()
    first, best, runner, verdicts = settled(plan, factors, said)  # 0.85 * 0.8 * 0.9 * 1.2 of the baseline's time

    assert best is not first and best.accepted
    assert best.plan == Plan(actions=[PAD, PadOps(multiple=8), Compile(mode="fused")])
    assert best.speed.speedup > first.speed.speedup
    assert len(best.left_out) == 1 and best.left_out[0].startswith("precision (numerics) (matmul_precision")
    assert "it slowed the verified plan" in best.left_out[0]
    # The first plan's ablation measured four units; the smaller plan's, three, each earning its place.
    added = {a.unit: a.speed.speedup for a in best.attribution}
    assert set(added) == {"padding (model)", "padding", "execution (numerics)"}
    assert abs(added["padding"] - 1 / 0.8) < 0.05 and abs(added["execution (numerics)"] - 1 / 0.9) < 0.05
    assert [(a.group, a.effect) for a in best.attribution] == [("padding", "model"), ("padding", "exact"),
                                                               ("execution", "numerics")]
    assert '"unit":"padding (model)"' in best.model_dump_json()  # report.json names the unit as the report does
    assert [m[0] for m in runner.measured] == [
        "verify-1-1", "verify-1-2", "verify-1-3", "ablate-padding-model", "ablate-padding",
        "ablate-execution-numerics", "ablate-precision-numerics", "verify-2-1", "verify-2-2", "verify-2-3",
        "ablate-padding-model", "ablate-padding", "ablate-execution-numerics"]  # 3 fresh process pairs a verification
    assert verdicts == [best]
    lines = said.out.getvalue().splitlines()  # what the tune's console says, one line each
    assert [line.split(" adds ")[0] for line in lines if " adds " in line] == [
        "  padding (model) (WIDTH 63->64 (t.py:3))", '  padding (pad_ops {"multiple":8})',
        "  execution (numerics) (compile {\"mode\":\"fused\"})", '  precision (numerics) (matmul_precision '
        '{"precision":"default"})', "  padding (model) (WIDTH 63->64 (t.py:3))", '  padding (pad_ops {"multiple":8})',
        "  execution (numerics) (compile {\"mode\":\"fused\"})"]
    assert all(line.endswith("over the rest of the plan") for line in lines if " adds " in line)
    assert [line for line in lines if "left out" in line] == [f"  left out: {best.left_out[0]}"]
    assert (f"verify: {best.plan.describe()} (without precision (numerics))" in lines
            and f"  accepted: {best.reason}" in lines)

    text = report.markdown(_result(best, verdicts), {})
    assert "Left out of the search's best plan:* precision" in text and "Where the gain comes from" in text
    assert "| padding (model): WIDTH 63->64 (t.py:3) |" in text


def test_the_ablation_drops_a_neutral_bf16_group():
    """bf16 matmuls that neither help nor hurt: other rounding for nothing, so they go."""
    factors = {**FACTORS, "precision (numerics)": 1.0}
    first, best, _, _ = settled(Plan(actions=[Compile(mode="fused"), MatmulPrecision(precision="default")]), factors)
    assert best.accepted and best.plan == Plan(actions=[Compile(mode="fused")])
    (line,) = best.left_out
    assert line.startswith("precision (numerics)") and "stays only for a gain of its own that clears --min-gain" in line


def test_a_neutral_exact_group_is_dropped_and_a_model_change_must_clear_min_gain():
    factors = {"execution (numerics)": 0.8, "padding": 1.0, "padding (model)": 0.99}  # pad_ops neutral; PadDim 1.01x
    first, best, _, _ = settled(Plan(actions=[PAD, PadOps(multiple=8), Compile(mode="fused")]), factors)
    assert best.accepted and best.plan == Plan(actions=[Compile(mode="fused")])
    reasons = dict(line.split(": ", 1) for line in best.left_out)
    assert set(reasons) == {"padding (model) (WIDTH 63->64 (t.py:3))", 'padding (pad_ops {"multiple":8})'}
    assert "a model change stays only for a gain of its own" in reasons["padding (model) (WIDTH 63->64 (t.py:3))"]
    assert reasons['padding (pad_ops {"multiple":8})'].startswith("no gain of its own (neutral")


def test_exact_units_that_carry_a_gain_only_together_stay(monkeypatch):
    plan = Plan(actions=[PadOps(multiple=8), ActivationCheckpointing(every=1)])
    # each unit alone: about 1.005x with an interval spanning 1 (neutral)
    neutral = speedup([0.0100] * 20, [0.0099, 0.0101, 0.0098, 0.0100] * 5, min_gain=0.03, seed=0)
    assert neutral.ci_low <= 1.0 <= neutral.ci_high

    def measured(plan, measuring, out):
        out += [Attribution(group=xs[0].group, effect=xs[0].effect, actions=Plan(actions=xs).describe(), without="-",
                            speed=neutral, reason="") for xs in plan.units().values()]
        return out

    monkeypatch.setattr(ablation, "attribute", measured)
    first = Verdict(plan=plan, accepted=True, reason="verified together")
    best = ablation.settle(first, Measuring(FakeRunner(), TuneSettings(seed=0)), Said())
    assert best is first and best.accepted and best.left_out == []  # together they carried the gain: both stay


def test_a_single_group_plan_is_not_ablated():
    runner = FakeRunner()
    verdict = verify(Plan(actions=[PAD]), Measuring(runner, TuneSettings(seed=0)))
    best = settle(verdict, Measuring(runner, TuneSettings(seed=0)), Said())
    assert best is verdict and best.attribution == [] and best.left_out == []


def _result(best, verdicts):
    from tpu_agent.report.result import TuneResult

    return TuneResult(script="t.py", args=[], settings=TuneSettings(), study="s", storage="sqlite://", run_dir=".",
                      best=best, verdicts=[best, *verdicts])


def test_verification_leaves_out_pairs_in_which_the_candidate_compiled():
    """A candidate still compiling in its first 4 timed steps (5x slower) is judged on its steady pairs: each of the
    3 process pairs measures until it has 7 of them."""
    verdict = verify(Plan(actions=[Compile(mode="fused")]), Measuring(FakeRunner(compiling=4), TuneSettings(seed=0)))
    assert verdict.accepted and abs(verdict.speed.speedup - 1 / 0.9) < 0.03
    assert verdict.speed.pairs == 21 and verdict.speed.processes == 3  # 3 x 11 pairs, 4 of each compiling
    assert "12 of 33 pairs left out: a process compiled in them" in verdict.reason  # said, not hidden
    assert "21 pairs in 3 process pairs" in verdict.reason
