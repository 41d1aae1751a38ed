"""A candidate change: data, never code, checked against the `Plan` action models.

A candidate holds action templates (the `Plan` action kinds only) with the
values to search, the evidence that motivated it, a rank score, and who
proposed it. The search turns each option into plan actions through
`Candidate.options()`, which validates every one with the `Plan` models, so
nothing a proposer emits can bypass the schema.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from tpu_agent.config import ChosenProposer
from tpu_agent.plan.actions import Action, ActionKind, Plan

MAX_OPTIONS = 64  # per candidate: a search space a person can still read
_ACTION = TypeAdapter(Action)


def action_key(action) -> str:
    """What the action changes, canonical: its class fields (effect, batch) are the tool's reading, not the change."""
    return json.dumps(action.model_dump(mode="json", exclude={"effect", "batch"}), sort_keys=True)


class Evidence(BaseModel):
    """Why a candidate exists: the op, the dim (its size and roles) and its waste, or a measured time."""

    what: str = Field(description="one line for people")
    op: str | None = Field(None, description="the hot op, as 'aten op @ file:line'")
    dim: str | None = Field(None, description="matmul roles of the dim: M rows, K contracted, N columns")
    size: int | None = None
    padded_to: int | None = None
    waste: float | None = Field(None, description="estimate: this dim's share of the padded dot/conv work")
    wasted_flops_per_step: float | None = Field(None, description="estimate")
    time_s: float | None = Field(None, description="measured")
    metric: str | None = None
    value: float | str | None = None
    estimate: bool = False


class ActionTemplate(BaseModel):
    """One action kind with fixed fields and, per field, the values to search."""

    model_config = ConfigDict(extra="forbid")

    kind: ActionKind
    fixed: dict[str, Any] = Field(default_factory=dict)
    choices: dict[str, list[Any]] = Field(default_factory=dict)
    tied: list[dict[str, Any]] = Field(default_factory=list, description=(
        "pad_dim only: more literals (file, line, column, old, name) rewritten to the same `new` "
        "(one dim written in several places)"))

    def expand_options(self) -> list[tuple[Action, ...]]:
        """Like `expand`, with each pad_dim joined by its tied copies (same `new`)."""
        out = []
        for action in self.expand():
            extra = tuple(_ACTION.validate_python({**action.model_dump(), **pos}) for pos in self.tied)
            out.append((action, *extra))
        return out

    def expand(self) -> list[Action]:
        """Every action this template stands for, each validated by the plan models."""
        fields = sorted(self.choices)
        combos = itertools.product(*(self.choices[f] for f in fields)) if fields else [()]
        out: list[Action] = []
        seen = set()
        for combo in combos:
            data = {**self.fixed, **dict(zip(fields, combo)), "kind": self.kind}
            action = _ACTION.validate_python(data)
            key = json.dumps(action.model_dump(mode="json"), sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(action)
        return out

    @model_validator(mode="after")
    def _tied_pad_dims_only(self):
        if self.tied and self.kind != "pad_dim":
            raise ValueError("only pad_dim actions have tied literals")
        return self

    def target(self) -> str:
        """What it changes, independent of the chosen values: merges duplicate candidates."""
        if self.kind == "pad_dim":
            spots = sorted(f"{p.get('file')}:{p.get('line')}:{p.get('column')}" for p in [self.fixed, *self.tied])
            return "pad_dim@" + ",".join(spots)
        if self.kind == "shard_rule":
            return f"shard_rule@{self.fixed.get('pattern', '*')}"
        if self.kind == "pad_ops" and self.fixed.get("sizes"):  # targeted padding is another change than padding all
            return f"pad_ops@{','.join(map(str, sorted(self.fixed['sizes'])))}"
        if self.kind == "expert_capacity":  # room for every token (exact) and a factor that drops (training): two
            return f"expert_capacity@{'/'.join(sorted({a.effect for a in self.expand()}))}"  # changes, scoped apart
        return self.kind


class Candidate(BaseModel):
    """A proposed change with its search space, its evidence and its rank."""

    id: str
    title: str
    proposer: ChosenProposer = Field(description="the proposer that produced it")
    playbook: str | None = Field(None, description="the playbook it came from (offline), or the one the model cited")
    also_playbooks: list[str] = Field(default_factory=list, description="other playbooks that proposed the same change")
    actions: list[ActionTemplate] = Field(min_length=1)
    evidence: list[Evidence] = Field(default_factory=list)
    tier: int = Field(2, description="1: the padding report points at it; 2: other profile evidence; 3: generic")
    score: float = Field(0.0, description="offline: estimated share of the step saved x confidence; claude: the model's order")
    rank: int = Field(0, description="1-based position in its proposer's list")
    preserves_numerics: bool
    reason: str = ""

    def options(self) -> list[tuple[Action, ...]]:
        """Every combination of the templates' values, each checked as a plan (at most MAX_OPTIONS)."""
        per_template = [t.expand_options() for t in self.actions]
        out = []
        for combo in itertools.product(*per_template):
            actions = tuple(a for part in combo for a in part)
            Plan(actions=list(actions))  # raises on an inconsistent combination
            out.append(actions)
            if len(out) > MAX_OPTIONS:
                raise ValueError(f"candidate {self.id} has more than {MAX_OPTIONS} options")
        return out

    def target(self) -> str:
        return "+".join(sorted(t.target() for t in self.actions))


def numerics_preserved(templates: Sequence[ActionTemplate]) -> bool:
    """True only if every option of every template preserves numerics."""
    return all(a.preserves_numerics for t in templates for a in t.expand())
