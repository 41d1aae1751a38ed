"""Each parallelism action the search tried, run alone against the baseline for its memory per rank.

Why: the search's trials combine actions (fused execution, padding and FSDP2's reshard in one plan), so a trial's
memory per rank is its whole plan's. What one parallelism change does to each rank's in-step peak is measured
here, the action alone in a 2-pair interleaved run against the warm baseline (memory is deterministic step to
step, so few pairs do; its speed over so few pairs is not reported).
"""

from __future__ import annotations

from typing import Callable

from tpu_agent.measure.compare import rank_memory
from tpu_agent.measure.runner import Runner
from tpu_agent.measure.trials import TrialFailed
from tpu_agent.plan.actions import Plan

from .measured import MeasuredPlan, is_parallelism

MAX_ALONE = 4  # actions measured alone; each one a candidate job of N ranks (start-up included: tens of seconds)
PAIRS = 2


def actions_tried(plans: list[Plan]) -> list[Plan]:
    """One plan per distinct parallelism action in `plans`: one of each kind first (kinds in the order first met),
    then the second of each, and so on, so that MAX_ALONE covers every kind; FSDP2's reshard=False before True
    (True is FSDP2's default, most often the script's own: a repeat of the baseline)."""
    kinds: dict[str, dict[str, Plan]] = {}
    for plan in plans:
        for action in plan.actions:
            alone = Plan(actions=[action])
            if is_parallelism(alone):
                kinds.setdefault(action.kind, {}).setdefault(action.describe(), alone)
    columns = [sorted(seen.values(), key=lambda p: bool(getattr(p.actions[0], "reshard", False)))
               for seen in kinds.values()]
    return [col[i] for i in range(max(map(len, columns), default=0)) for col in columns if i < len(col)]


def measure_alone(plans: list[Plan], runner: Runner, say: Callable[[str], None]) -> list[MeasuredPlan]:
    """Each plan's memory per rank against the baseline's (medians over PAIRS pairs); a failed run is a row with
    its reason."""
    rows = []
    for i, plan in enumerate(plans[:MAX_ALONE], 1):
        try:
            a, b, _cand = runner.measure(plan, f"alone-{i}", PAIRS)
        except TrialFailed as exc:
            rows.append(MeasuredPlan(trial=None, plan=plan, state="failed", note=f"{exc.kind}: {exc.message[:120]}"))
            say(f"  {plan.describe()} alone: failed: {exc.kind}")
            continue
        memory = list(zip(rank_memory(a), rank_memory(b)))
        row = MeasuredPlan(trial=None, plan=plan, state="alone", rank_memory=memory or None)
        rows.append(row)
        say(f"  {plan.describe()} alone: memory per rank, measured: {row.memory_text()}")
    if len(plans) > MAX_ALONE:
        say(f"  {len(plans) - MAX_ALONE} more parallelism action(s) not measured alone (at most {MAX_ALONE})")
    return rows
