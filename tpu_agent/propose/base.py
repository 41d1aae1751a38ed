"""The proposer's contract: a `Profile`, the `Knob`s, the playbooks and the trial outcomes in; a `ProposalRound` out.

Every proposer subclasses `Proposer` and takes exactly these typed inputs
(no dicts, no field-name guessing); what it proposes is `Candidate`s
(candidates.py), data checked against the `Plan` action models.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Sequence

from pydantic import BaseModel, Field

from tpu_agent.config import ChosenProposer
from tpu_agent.plan.actions import Action
from tpu_agent.profilers.schema import Profile
from tpu_agent.propose.candidates import Candidate, action_key
from tpu_agent.propose.knobs import Knob
from tpu_agent.propose.playbook import Playbook

OutcomeStatus = Literal["accepted", "rejected", "failed", "pruned", "measured", "invalid"]


class TrialOutcome(BaseModel):
    """What a proposer knows of one finished trial (the search's TrialRecord.outcome())."""

    number: int | None = None
    candidate: str | None = Field(None, description="the candidate id(s) it came from")
    actions: list[Action] = Field(default_factory=list, description="the trial's plan actions")
    status: OutcomeStatus = "measured"
    speedup: float | None = Field(None, description="baseline step time / trial step time")
    step_s: float | None = None
    loss_ok: bool | None = None
    note: str | None = None

    def action_keys(self) -> frozenset[str]:
        """Its actions as canonical JSON."""
        return frozenset(action_key(a) for a in self.actions)


class TokenUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    calls: int = 0
    budget: int | None = None

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


class ProposalRound(BaseModel):
    """One round's answer: the ranked candidates and how they were reached."""

    proposer: ChosenProposer = Field(description="who produced the candidates")
    requested: ChosenProposer = Field(description="who was asked")
    round: int = 1
    candidates: list[Candidate] = Field(default_factory=list)
    transcript: list[dict[str, Any]] = Field(default_factory=list, description="offline: playbook matching; claude: the exchange")
    notes: list[str] = Field(default_factory=list, description="said out loud: fallbacks, budget")
    fallback: str | None = Field(None, description="why the requested proposer was replaced by the offline one")
    usage: TokenUsage | None = None


class Proposer(ABC):
    """What the pipeline calls once per round."""

    name: ClassVar[ChosenProposer]

    @abstractmethod
    def propose(self, profile: Profile, knobs: Sequence[Knob] = (), playbooks: Sequence[Playbook] | None = None,
                results: Sequence[TrialOutcome] = (), round: int = 1) -> ProposalRound:
        """Ranked candidates for `profile`; `playbooks` None means the built-in ones."""
