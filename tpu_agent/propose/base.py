"""What every proposer takes and gives: knobs and trial results in, ranked `Candidate`s out.

A candidate is data, never code: action templates (the `Plan` action kinds
only) with the values to search, the evidence that motivated it, a rank
score, and who proposed it. The search (tune) turns each option into plan
actions through `Candidate.options()`, which validates every one with the
`Plan` models, so nothing a proposer emits can bypass the schema.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Literal, Protocol, Sequence

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from tpu_agent.plan.actions import ACTION_KINDS, Action, Plan

ActionKind = Literal["pad_dim", "pad_ops", "mesh", "shard_rule", "batch_sharding", "compile", "matmul_precision"]
assert set(ActionKind.__args__) == set(ACTION_KINDS)  # one list of kinds, kept in step with plan.py

MAX_OPTIONS = 64  # per candidate: a search space a person can still read
_ACTION = TypeAdapter(Action)


class KnobRef(BaseModel):
    """An integer literal of the user's source that becomes a tensor dim (the input PadDim needs).

    Stand-in until `tpu_agent.knobs.Knob` lands: it reads that model (or a
    dict) by attribute, under the names it is likely to use.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True, from_attributes=True)

    file: str
    line: int = Field(ge=1)
    column: int = Field(ge=0)
    value: int
    name: str | None = None
    aligned: list[int] = Field(default_factory=list, validation_alias=AliasChoices(
        "aligned", "candidates", "aligned_values", "aligned_candidates", "choices"))
    dims: list[int] = Field(default_factory=list, validation_alias=AliasChoices(
        "dims", "matches", "hot_dims", "matched_dims", "hot_op_dims"))
    batch: bool | None = Field(None, description="it sets the batch size (None: the finder did not say)")
    overridden: str | None = Field(None, description="why the literal is not the value in use (then padding it is moot)")
    group: str | None = Field(None, description="literals of one group are one dim written several times: padded together")

    @field_validator("aligned", "dims", mode="before")
    @classmethod
    def _sizes(cls, value):
        """Accept plain ints or records that carry a `size` (or `value`)."""
        if value is None:
            return []
        out = []
        for item in value:
            if isinstance(item, int):
                out.append(item)
                continue
            data = item if isinstance(item, dict) else getattr(item, "__dict__", {})
            size = data.get("size", data.get("value"))
            if isinstance(size, int):
                out.append(size)
        return out

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"

    @property
    def is_batch(self) -> bool:
        """The finder's word, else the name: BATCH, batch_size, bs, bsz."""
        if self.batch is not None:
            return self.batch
        words = [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", self.name or "")]
        return any(w.startswith("batch") or w in ("bs", "bsz") for w in words)

    def position(self) -> dict[str, Any]:
        """The PadDim fields that say which literal to rewrite."""
        return {"file": self.file, "line": self.line, "column": self.column, "old": self.value, "name": self.name}

    def group_members(self, knobs: Sequence["KnobRef"]) -> list["KnobRef"]:
        """The other literals of its group (one dim written in several places)."""
        if self.group is None:
            return []
        return [k for k in knobs if k.group == self.group and k.id != self.id]

    @property
    def label(self) -> str:
        return f"{self.name} = {self.value} ({self.id})" if self.name else f"{self.value} at {self.id}"


def coerce_knobs(knobs: Sequence[Any] | None) -> list[KnobRef]:
    out = []
    for k in knobs or ():
        if isinstance(k, KnobRef):
            out.append(k)
        elif isinstance(k, dict):
            out.append(KnobRef.model_validate(k))
        elif isinstance(k, BaseModel):
            out.append(KnobRef.model_validate(k.model_dump()))
        else:
            out.append(KnobRef.model_validate(k, from_attributes=True))
    return out


class TrialOutcome(BaseModel):
    """What a proposer needs to know of one finished trial (the tune command's TrialResult is richer)."""

    model_config = ConfigDict(extra="allow")

    number: int | None = None
    candidate: str | None = Field(None, description="the candidate id(s) it came from")
    actions: list[dict[str, Any]] = Field(default_factory=list, description="the trial's plan actions")
    status: str = Field("measured", description="accepted | rejected | failed | pruned | measured")
    speedup: float | None = Field(None, description="baseline step time / trial step time")
    step_s: float | None = None
    loss_ok: bool | None = None
    note: str | None = None

    def action_keys(self) -> frozenset[str]:
        """Its actions as canonical JSON (empty when they do not form a valid plan)."""
        try:
            plan = Plan(actions=self.actions)
        except ValueError:
            return frozenset()
        return frozenset(action_key(a) for a in plan.actions)


def action_key(action) -> str:
    return json.dumps(action.model_dump(mode="json"), sort_keys=True)


def coerce_results(results: Sequence[Any] | None) -> list[TrialOutcome]:
    out = []
    for r in results or ():
        if isinstance(r, TrialOutcome):
            out.append(r)
            continue
        data = r.model_dump(mode="json") if isinstance(r, BaseModel) else dict(r)
        plan = data.get("plan")
        if not data.get("actions") and isinstance(plan, dict):
            data["actions"] = plan.get("actions", [])
        out.append(TrialOutcome.model_validate(data))
    return out


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
        return self.kind


class Candidate(BaseModel):
    """A proposed change with its search space, its evidence and its rank."""

    id: str
    title: str
    proposer: str = Field(description="offline | claude")
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

    proposer: str = Field(description="who produced the candidates: offline | claude")
    requested: str = Field(description="who was asked: offline | claude")
    round: int = 1
    candidates: list[Candidate] = Field(default_factory=list)
    transcript: list[dict[str, Any]] = Field(default_factory=list, description="offline: playbook matching; claude: the exchange")
    notes: list[str] = Field(default_factory=list, description="said out loud: fallbacks, budget")
    fallback: str | None = Field(None, description="why the requested proposer was replaced by the offline one")
    usage: TokenUsage | None = None


class Proposer(Protocol):
    """The interface tune calls once per round."""

    name: str

    def propose(self, profile, knobs: Sequence[Any] = (), playbooks=None, results: Sequence[Any] = (),
                round: int = 1) -> ProposalRound: ...
