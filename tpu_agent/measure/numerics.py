"""The numerics check: a plan's losses against the baseline's at the same steps.

An exact plan (same math) must reproduce every step's loss within float32 noise; any other plan must not end
with a loss worse than the baseline's beyond `--loss-tol`. Pure arithmetic on the losses the runner read, as
the search's trials and the verification both check them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

from tpu_agent.config import TuneOptions
from tpu_agent.plan.actions import PadBatch, Plan

EXACT_RTOL = 1e-5
LOSS_TOL: float = TuneOptions.model_fields["loss_tol"].default  # --loss-tol's default, declared in config
LOSS_TAIL = 3  # steps averaged for "the loss at the end": one step's loss depends on its batch


class NumericsCheck(BaseModel):
    """Did the candidate's losses stay where they should?"""

    kind: Literal["exact", "loss_tol"] = Field(
        description="exact: every step's loss matches the baseline's; loss_tol: the final loss is no worse beyond a tolerance")
    passed: bool
    reason: str
    tolerance: float
    steps: int = Field(description="steps compared")
    max_rel_diff: float | None = Field(None, description="exact: the largest relative difference of any step")
    worst_step: int | None = Field(None, description="exact: 0-based index of that step")
    baseline_final: float | None = Field(None, description="loss_tol: mean of the baseline's last steps")
    candidate_final: float | None = None
    tail: int | None = Field(None, description="loss_tol: how many last steps were averaged")


def _losses(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values]


def _not_finite(baseline: list[float], candidate: list[float]) -> tuple[int, str] | None:
    """The first step at which either side's loss is NaN or infinite, and what to say: such a loss matches
    nothing, not even the same NaN on the other side (two diverged runs are not a verified change)."""
    for side, losses in (("baseline", baseline), ("candidate", candidate)):
        for i, value in enumerate(losses):
            if not math.isfinite(value):
                return i, f"the {side}'s loss is not finite at compared step {i}: {value}"
    return None


def check_exact(baseline_losses: Sequence[float], candidate_losses: Sequence[float], *,
                rtol: float = EXACT_RTOL) -> NumericsCheck:
    """A plan that preserves numerics must reproduce every per-step loss within `rtol` (relative, float32 noise)."""
    a, b = _losses(baseline_losses), _losses(candidate_losses)
    if not a:
        return NumericsCheck(kind="exact", passed=False, reason="the baseline recorded no losses", tolerance=rtol, steps=0)
    if len(a) != len(b):
        return NumericsCheck(kind="exact", passed=False, tolerance=rtol, steps=min(len(a), len(b)),
                             reason=f"step count differs: baseline {len(a)} losses, candidate {len(b)}")
    bad = _not_finite(a, b)
    if bad is not None:
        return NumericsCheck(kind="exact", passed=False, tolerance=rtol, steps=len(a), max_rel_diff=math.inf,
                             worst_step=bad[0], reason=bad[1])
    worst, worst_step = 0.0, 0
    for i, (x, y) in enumerate(zip(a, b)):
        # Denominator floor: a loss of exactly 0 would make any difference infinitely "relative".
        rel = abs(x - y) / max(abs(x), abs(y), 1e-8)
        if rel > worst:
            worst, worst_step = rel, i
    passed = worst <= rtol
    verdict = "within" if passed else "beyond"
    reason = (f"per-step losses match the baseline {verdict} {rtol:g} relative "
              f"(largest difference {worst:.2e} at step {worst_step}, {len(a)} steps)")
    return NumericsCheck(kind="exact", passed=passed, reason=reason, tolerance=rtol, steps=len(a),
                         max_rel_diff=worst, worst_step=worst_step)


def check_loss_tol(baseline_losses: Sequence[float], candidate_losses: Sequence[float], *,
                   loss_tol: float = LOSS_TOL, tail: int = LOSS_TAIL) -> NumericsCheck:
    """A shape-changing plan must end with a loss no worse than the baseline's by more than `loss_tol` (relative).

    "The end" is the mean of the last `tail` steps of each run (fewer when the
    run is shorter), so one unlucky batch does not decide.
    """
    a, b = _losses(baseline_losses), _losses(candidate_losses)
    if not a or not b:
        side = "baseline" if not a else "candidate"
        return NumericsCheck(kind="loss_tol", passed=False, reason=f"the {side} recorded no losses", tolerance=loss_tol,
                             steps=0)
    n = max(1, min(tail, len(a), len(b)))
    bad = _not_finite(a, b)
    if bad is not None:
        return NumericsCheck(kind="loss_tol", passed=False, tolerance=loss_tol, steps=min(len(a), len(b)), tail=n,
                             reason=bad[1])
    base = sum(a[-n:]) / n
    cand = sum(b[-n:]) / n
    limit = base + loss_tol * abs(base)
    passed = cand <= limit
    change = (cand - base) / abs(base) if base else math.inf if cand > base else 0.0
    verdict = "no worse than" if passed else "worse than"
    reason = (f"final loss {cand:.6g} vs baseline {base:.6g} ({change:+.2%}; mean of the last {n} steps): "
              f"{verdict} the {loss_tol:.0%} tolerance")
    return NumericsCheck(kind="loss_tol", passed=passed, reason=reason, tolerance=loss_tol, steps=min(len(a), len(b)),
                         baseline_final=base, candidate_final=cand, tail=n)


def check_numerics(baseline_losses: Sequence[float], candidate_losses: Sequence[float], *, preserves_numerics: bool,
                   rtol: float = EXACT_RTOL, loss_tol: float = LOSS_TOL, tail: int = LOSS_TAIL) -> NumericsCheck:
    """The check a plan calls for: exact for plans that preserve numerics, else the loss tolerance."""
    if preserves_numerics:
        return check_exact(baseline_losses, candidate_losses, rtol=rtol)
    return check_loss_tol(baseline_losses, candidate_losses, loss_tol=loss_tol, tail=tail)


def check_plan_numerics(plan: Plan, baseline_losses: Sequence[float], candidate_losses: Sequence[float],
                        options: TuneOptions) -> tuple[NumericsCheck, Plan]:
    """The check `plan` calls for, and the plan as its losses class it.

    Batches padded with the script's own pad values are exact only when the losses say so: a script whose
    loss counts the padded positions (no ignore index, no mask) trains on other numbers. Such a plan is held
    to the loss tolerance as a change of training, when `--allow training` searches those.
    """
    numerics = check_numerics(baseline_losses, candidate_losses, preserves_numerics=plan.preserves_numerics,
                              loss_tol=options.loss_tol)
    masked = [a for a in plan.actions if isinstance(a, PadBatch) and a.masked]
    if numerics.passed or numerics.kind != "exact" or not masked or numerics.steps == 0:
        return numerics, plan
    actions = [a.model_copy(update={"masked": False, "effect": "training"}) if a in masked else a
               for a in plan.actions]
    training = plan.model_copy(update={"actions": actions})
    why = f"losses differ from the baseline's ({numerics.reason}): the padded positions count in the loss"
    if "training" not in options.allow:
        return numerics.model_copy(update={
            "reason": f"{why}, so padding the batches changes training (searched with --allow training)"}), plan
    check = check_numerics(baseline_losses, candidate_losses, preserves_numerics=training.preserves_numerics,
                           loss_tol=options.loss_tol)
    return check.model_copy(update={"reason": f"{why}; as a change of training: {check.reason}"}), training
