"""The ablation of a verified plan: what each unit of its actions adds, and the units that do not earn their place
left out.

A unit is a group of actions (padding, execution, precision, sharding) split by what it does to the model
(plan.actions.unit_of). A unit that is not `exact` (other rounding, another architecture, other training) stays
only when its own interval clears `--min-gain`: a user accepts such a change for a gain, never for noise. An
`exact` unit stays when its interval lies above 1; a neutral one goes too (fewer moving parts). What is left out
is said, with its figures, through the watcher (what it measures, never how it is shown), and the smaller plan
is verified again.
"""

from __future__ import annotations

from typing import Protocol

from tpu_agent.measure.context import Measuring
from tpu_agent.measure.trials import TrialFailed
from tpu_agent.plan.actions import Plan
from tpu_agent.verify.verdict import Attribution, Verdict, verify

__all__ = ["AblationWatcher", "attribute", "settle"]


class AblationWatcher(Protocol):
    """Who records and says what the ablation finds (report.progress.TuneProgress)."""

    def unit_added(self, attribution: Attribution) -> None:
        """What one unit adds over the rest of the plan (or why it was not measured)."""

    def trimming(self, smaller: Plan, without: list[str], left_out: list[str]) -> None:
        """The units left out (each `unit (actions): why`); `smaller` is verified next."""

    def verified(self, verdict: Verdict) -> None:
        """The smaller plan's verdict (kept with the tune's verdicts)."""


def attribute(plan: Plan, measuring: Measuring, out: list[Attribution] | None = None) -> list[Attribution]:
    """Ablate a verified plan: each unit of its actions against the plan without it, so a gain is not credited
    to padding when fused execution carried it (or the reverse). Only for plans of two units or more. Each
    measured unit is appended to `out` as it finishes (an interrupted ablation keeps those)."""
    out = [] if out is None else out
    units = plan.units()
    if len(units) < 2:
        return out
    for unit, actions in units.items():
        without = Plan(actions=[a for a in plan.actions if a not in actions])
        text = Plan(actions=actions).describe()
        group, effect = actions[0].group, actions[0].effect
        try:
            name = "ablate-" + unit.replace(" (", "-").rstrip(")")  # ablate-padding-model
            a, b = measuring.runner.measure_plans(without, plan, name)
        except TrialFailed as exc:
            no_change = exc.kind == "no_change"
            out.append(Attribution(group=group, effect=effect, actions=text, without=without.describe(),
                                   reason=exc.message if no_change else f"not measured: {exc.kind}: {exc.message[:160]}",
                                   no_change=no_change))
            continue
        speed = measuring.compare(a, b, plan, without=without).speedup()
        out.append(Attribution(group=group, effect=effect, actions=text, without=without.describe(), speed=speed,
                               reason=speed.reason))
    return out


def why_dropped(a: Attribution, min_gain: float) -> str | None:
    """Why a measured unit does not earn its place in the plan (None: it does)."""
    if a.no_change:
        return a.reason
    if a.speed is None:
        return None
    if a.speed.ci_high < 1.0:
        return f"it slowed the verified plan, {a.speed.text()}"
    if a.effect != "exact" and not a.speed.accepted:
        return (f"a {a.effect} change stays only for a gain of its own that clears --min-gain "
                f"({1 + min_gain:.2f}x); it adds {a.speed.text()}")
    if a.effect == "exact" and a.speed.ci_low <= 1.0:
        return f"no gain of its own (neutral, fewer moving parts without it): it adds {a.speed.text()}"
    return None


def settle(verdict: Verdict, measuring: Measuring, watcher: AblationWatcher) -> Verdict:
    """Ablate a verified plan and leave out the units that do not earn their place; the smaller plan is verified
    (then ablated) in turn, until every unit left earns its place. Returns the plan to keep: a rejected verdict
    when what is left is not verified and a change to the model's numerics, architecture or training was what
    carried the gain."""
    while True:
        verdict.attribution = []
        attribute(verdict.plan, measuring, out=verdict.attribution)
        for a in verdict.attribution:
            watcher.unit_added(a)
        drop = {a.unit: why for a in verdict.attribution if (why := why_dropped(a, measuring.options.min_gain))}
        if drop and set(drop) == set(verdict.plan.units()):
            # together the exact units carried a gain none shows alone: they stay, the others go
            drop = {unit: why for unit, why in drop.items() if not unit_is_exact(verdict, unit)}
        if not drop:
            return verdict
        units = verdict.plan.units()
        smaller = Plan(actions=[x for unit, xs in units.items() if unit not in drop for x in xs])
        left_out = [f"{unit} ({Plan(actions=units[unit]).describe()}): {why}" for unit, why in drop.items()]
        watcher.trimming(smaller, list(drop), left_out)
        if not smaller.actions:
            return verdict.model_copy(update={"accepted": False, "left_out": verdict.left_out + left_out, "reason": (
                "no unit of the plan verified a gain of its own: " + "; ".join(left_out))})
        trimmed = verify(smaller, measuring)
        trimmed.left_out = verdict.left_out + left_out
        watcher.verified(trimmed)
        if not trimmed.accepted:
            if all(unit_is_exact(verdict, unit) for unit in drop):
                return verdict  # only exact units were in question: the verified plan stands as it is
            return trimmed  # the gain needed a change that did not earn its place: nothing is kept
        verdict = trimmed


def unit_is_exact(verdict: Verdict, unit: str) -> bool:
    return all(a.effect == "exact" for a in verdict.plan.units()[unit])
