"""The ablation of a verified plan: what each group of its actions adds, and a group that slows it left out."""

from __future__ import annotations

from tpu_agent.config import TuneOptions
from tpu_agent.plan.actions import GROUPS, Plan
from tpu_agent.search.measure import Runner, batch_size
from tpu_agent.search.trials import TrialFailed
from tpu_agent.verify.stats import speedup
from tpu_agent.verify.verdict import Attribution, Verdict, verify

__all__ = ["GROUPS", "attribute", "settle"]


def attribute(plan: Plan, runner: Runner, options: TuneOptions, baseline_batch: int | None,
              out: list[Attribution] | None = None) -> list[Attribution]:
    """Ablate a verified plan: each group of its actions against the plan without it, so a gain is not
    credited to padding when fused execution carried it (or the reverse). Only for plans of two groups or more.
    Each measured group is appended to `out` as it finishes (an interrupted ablation keeps those)."""
    out = [] if out is None else out
    groups = plan.groups()
    if len(groups) < 2:
        return out
    for group, actions in groups.items():
        without = Plan(actions=[a for a in plan.actions if a not in actions])
        text = Plan(actions=actions).describe()
        try:
            a, b = runner.measure_plans(without, plan, f"ablate-{group}", options.verify_pairs)
        except TrialFailed as exc:
            out.append(Attribution(group=group, actions=text, without=without.describe(),
                                   reason=f"not measured: {exc.kind}: {exc.message[:160]}"))
            continue
        before, after = batch_size(without, baseline_batch), batch_size(plan, baseline_batch)
        per_sample = baseline_batch is not None and before != after
        speed = speedup([s.wall_s for s in a], [s.wall_s for s in b], min_gain=options.min_gain, seed=options.seed,
                        baseline_batch=before if per_sample else None, candidate_batch=after if per_sample else None)
        out.append(Attribution(group=group, actions=text, without=without.describe(), speed=speed, reason=speed.reason))
    return out


def _verdict_line(console, verdict: Verdict) -> None:
    console.print(("  [green]accepted[/green]: " if verdict.accepted else "  [red]rejected[/red]: ") + verdict.reason)


def settle(verdict: Verdict, runner: Runner, options: TuneOptions, baseline_batch: int | None, profile,
           console, verdicts: list[Verdict]) -> Verdict:
    """Ablate a verified plan; when a group of its actions verifiably slows it (the interval of what it adds
    lies below 1), verify the plan without that group and keep it if it passes (then ablate that one)."""
    verdict.attribution = []
    attribute(verdict.plan, runner, options, baseline_batch, out=verdict.attribution)
    for a in verdict.attribution:
        console.print(f"  {a.group} ({a.actions}) adds {a.speed.text() if a.speed else a.reason} over the rest of the plan")
    slow = [a for a in verdict.attribution if a.speed and a.speed.ci_high < 1.0]
    if not slow:
        return verdict
    groups = {a.group for a in slow}
    smaller = Plan(actions=[x for x in verdict.plan.actions if x.group not in groups])
    if not smaller.actions:
        return verdict
    left_out = [f"{a.group} ({a.actions}): it slowed the verified plan, {a.speed.text()}" for a in slow]
    console.print(f"[bold]verify[/bold]: {smaller.describe()} (without {', '.join(sorted(groups))}, which slowed it)")
    trimmed = verify(smaller, runner, options, baseline_batch, profile)
    verdicts.append(trimmed)
    _verdict_line(console, trimmed)
    if not trimmed.accepted:
        return verdict
    trimmed.left_out = verdict.left_out + left_out
    return settle(trimmed, runner, options, baseline_batch, profile, console, verdicts)
