"""What every measurement of one tune is made against, in one object: the runner (its warm baseline, its fresh
processes), the tune's options, the batch size the unchanged script sets, the baseline's profile and the
baseline's losses gathered across trials. Built once per tune (pipeline.py) or per joining worker, and handed to
the search, the verification and the ablation, which read what they need of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tpu_agent.config import TuneOptions
from tpu_agent.measure.compare import Comparison
from tpu_agent.measure.runner import Runner
from tpu_agent.plan.actions import Plan

if TYPE_CHECKING:
    from tpu_agent.measure.trials import StepRecord
    from tpu_agent.profilers.schema import Profile


@dataclass
class Measuring:
    """The measuring context of a tune. `baseline_batch`: the batch the unchanged script sets (None: not found,
    times are compared per step); `profile`: the baseline's (None on a joined host that verifies, which never
    profiled it); `baseline_losses`: the baseline's loss at each (step, rank), the first one measured kept, added
    to by every trial (each trial's numerics check reads them)."""

    runner: Runner
    options: TuneOptions
    baseline_batch: int | None = None
    profile: Profile | None = None
    baseline_losses: dict[tuple[int, int], float] = field(default_factory=dict)

    def with_budget(self, trials: int) -> Measuring:
        """The same context for a search of `trials` trials (one round's share, a worker's budget); the runner
        and the losses gathered so far are shared, not copied."""
        return replace(self, options=self.options.model_copy(update={"trials": trials}))

    def compare(self, a: list[StepRecord], b: list[StepRecord], plan: Plan, **kw) -> Comparison:
        """The comparison of B (`plan`) with A, read with the tune's options and the baseline's batch."""
        return Comparison(a, b, plan, self.options, self.baseline_batch, **kw)
