"""What the search records of each trial, apart from Optuna: the report and the proposers read these records
without loading the study's code."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel

from tpu_agent.plan.actions import Plan
from tpu_agent.propose.base import OutcomeStatus, TrialOutcome


class TrialState(StrEnum):
    """How a trial ended, each state with what the proposers read of it (its OutcomeStatus)."""

    status: OutcomeStatus

    def __new__(cls, value: str, status: OutcomeStatus) -> TrialState:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        return member

    COMPLETE = "complete", "measured"
    NUMERICS = "numerics", "rejected"  # measured, its losses off
    REPEATED = "repeated", "measured"  # a plan measured before (or no change at all): not run again
    FAILED = "failed", "failed"
    PRUNED = "pruned", "pruned"
    INVALID = "invalid", "invalid"


# The states that measured a plan: they count against --trials (a repeat, an invalid plan or the baseline
# itself cost no measuring).
MEASURED = (TrialState.COMPLETE.value, TrialState.NUMERICS.value, TrialState.FAILED.value, TrialState.PRUNED.value)


class TrialRecord(BaseModel):
    number: int
    plan: Plan
    state: TrialState
    value: float | None = None
    speedup: float | None = None
    memory_ratio: float | None = None
    reason: str = ""
    duration_s: float = 0.0
    warmup_s: float | None = None  # the candidate's start-up and warm-up steps (imports, compiles)
    earlier: bool = False  # recorded by an earlier run of the study (--resume)
    host: str | None = None  # the host whose worker measured it
    rank_memory: list[tuple[int, int]] | None = None  # an N-rank job: each rank's (baseline, plan) peak device bytes

    def outcome(self) -> TrialOutcome:
        """The trial as the proposers read it."""
        return TrialOutcome(number=self.number, actions=list(self.plan.actions),
                            status=self.state.status, speedup=self.speedup,
                            loss_ok=self.state != TrialState.NUMERICS, note=self.reason or None)
