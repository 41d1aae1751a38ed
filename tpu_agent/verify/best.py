"""The verification phase: the search's best plans verified in turn, in fresh processes; the first accepted one
is ablated, and the plan left standing after its ablation is the tune's result."""

from __future__ import annotations

from typing import Protocol

from rich.console import Console

from tpu_agent.measure.context import Measuring
from tpu_agent.measure.noop import effective
from tpu_agent.plan.actions import Plan
from tpu_agent.verify.ablation import AblationWatcher, settle
from tpu_agent.verify.verdict import Verdict, verify


class Watcher(AblationWatcher, Protocol):
    """Who records and says what the verification does (report.progress.TuneProgress)."""
    console: Console

    def enter(self, phase: str) -> None: ...

    def verifying(self, plan: Plan) -> None: ...

    def verified(self, verdict: Verdict) -> None: ...

    def standing(self, verdict: Verdict | None) -> None: ...

    def script_failure(self, failure: tuple[int, str] | None) -> None: ...


def verify_best(plans: list[Plan], measuring: Measuring, watcher: Watcher) -> None:
    """A verified plan stands from the moment it is verified, so an interrupted ablation keeps it. A plan's no-op
    actions (measure.noop) are left out before it is measured; a plan of no-ops alone is said in one line and
    neither measured nor kept."""
    seen: set[str] = set()
    runner, options = measuring.runner, measuring.options
    for plan in plans[:options.verify]:
        plan, no_ops = effective(plan, measuring.profile)
        for line in no_ops:
            watcher.console.print(line + (" (not measured)" if not plan.actions else " (left out of the plan)"),
                                  markup=False)
        if not plan.actions or plan.key() in seen:
            continue
        seen.add(plan.key())
        watcher.verifying(plan)
        verdict = verify(plan, measuring)
        watcher.script_failure(runner.script_failure)
        watcher.verified(verdict)
        if not verdict.accepted:
            continue
        watcher.standing(verdict)
        if options.objective != "memory" and not verdict.estimate_note:
            watcher.enter("ablation")
            verdict = settle(verdict, measuring, watcher)
            watcher.enter("verification")
        watcher.standing(verdict if verdict.accepted else None)  # rejected: its gain needed what was left out
        if verdict.accepted:
            return
