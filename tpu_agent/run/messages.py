"""What the parent and a run's child process tell each other, as pydantic models (one JSON object a line).

Parent -> child, in the environment (`tpu_agent.envvars`): the profiler's
Settings (`TPU_AGENT_PROFILE`), a `TrialRequest` (`TPU_AGENT_TRIAL`) or a
Plan (`TPU_AGENT_PLAN`). Child -> parent, on pipes: a timing trial's
`Ready`, `StepRecord` and `Ended` lines; the profiler's `Progress` lines.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from tpu_agent.plan.actions import Plan


class TrialRequest(BaseModel):
    """A timing trial: apply `plan`, then step under the gate (`gate_fd` in, `report_fd` out); under PyTorch's
    launcher, which passes no descriptors on, each rank's gate and report are named pipes in `channels`."""

    plan: Plan
    gate_fd: int = -1
    report_fd: int = -1
    channels: str | None = Field(None, description="a folder of FIFOs gate-<RANK> and report-<RANK>, one pair a rank")


def channel_paths(folder: str, rank: int) -> tuple[str, str]:
    """A rank's gate and report FIFOs in a trial's `channels` folder (the parent makes them, each rank opens its
    own: PyTorch's launcher passes no descriptors on to the ranks)."""
    return f"{folder}/gate-{rank}", f"{folder}/report-{rank}"


class Ready(BaseModel):
    event: Literal["ready"] = "ready"
    notes: list[str] = Field(default_factory=list, description="what the plan's run-time actions did")


class StepRecord(BaseModel):
    """One step of a timing trial, measured in the child with the device synchronized at both ends."""

    # A NaN or infinite loss travels as such (JSON's default would write null: a step with no loss, which the
    # numerics check then skipped, and a diverged plan passed).
    model_config = ConfigDict(ser_json_inf_nan="constants")

    event: Literal["step"] = "step"
    step: int
    wall_s: float
    loss: float | None = None
    device_bytes: int = 0
    compiled: bool = Field(False, description="XLA compiled during the step: its time is not the steady state's")
    programs: str | None = Field(None, description="asked for: a fingerprint of the XLA programs the step ran and "
                                 "how often (run.programs); None when not asked or not known")


class Ended(BaseModel):
    event: Literal["end"] = "end"
    status: int
    error: str | None = None
    steps: int = 0


TrialMessage = Annotated[Union[Ready, StepRecord, Ended], Field(discriminator="event")]
TRIAL_MESSAGE: TypeAdapter = TypeAdapter(TrialMessage)


class Progress(BaseModel):
    """The profiler's progress, for the parent's progress bar."""

    event: Literal["running", "step", "stopping", "analysing", "done"]
    step: int | None = None
    wall_s: float | None = None
    compile_s: float | None = None
