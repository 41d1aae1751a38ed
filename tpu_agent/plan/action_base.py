"""What every plan action is: its group (what an ablation credits), its class (exact, numerics, model, training,
data) and the hooks each kind fills in (describe, instruction, effect note, run-time apply). Apart from the kinds so
that kinds can live in more than one module without importing `Plan`."""

from __future__ import annotations

import json
from typing import Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from tpu_agent.plan.applied import Applied


Group = Literal["padding", "execution", "precision", "sharding"]
# What an action does to the model, for the user: the same math (exact), the same model with other rounding
# (numerics), another architecture (model), another batch, sequence length or expert capacity (training), or other data (data:
# the tuner never proposes it). The search covers exact and numerics unless `--allow` opens more.
Effect = Literal["exact", "numerics", "model", "training", "data"]
EFFECTS: tuple[str, ...] = ("exact", "numerics", "model", "training", "data")
EFFECT_TEXT = {"exact": "same math", "numerics": "same model, other rounding", "model": "a different architecture",
               "training": "different training (batch, sequence length, or the tokens an expert takes)", "data": "a change to the data"}



class ActionBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    group: ClassVar[Group]  # and `effect` (see Effect), a field so that plan.json and report.json carry it
    single: ClassVar[bool] = True  # at most one per plan
    hint: ClassVar[str]  # its fields, as the Claude proposer's submit tool describes them

    # For actions whose class follows from a field: (field, its value -> effect). Decided, never given.
    effect_from: ClassVar[tuple[str, Callable[[object], str]] | None] = None

    @property
    def preserves_numerics(self) -> bool:
        """Only an exact change keeps the baseline's losses; every other class is held to a tolerance."""
        return self.effect == "exact"

    @model_validator(mode="before")
    @classmethod
    def _derived_effect(cls, data):
        if cls.effect_from is not None and isinstance(data, dict) and cls.effect_from[0] in data:
            field, effect_of = cls.effect_from
            data = {**data, "effect": effect_of(data[field])}
        return data

    def describe(self) -> str:
        fields = {k: v for k, v in self.model_dump().items() if k not in ("kind", "effect")}
        return f"{self.kind} {json.dumps(fields, separators=(',', ':'))}"

    def instruction(self) -> str | None:
        """How to get this action without tpu-agent, in the script or its environment (None: a source edit)."""
        return None

    def effect_note(self) -> str | None:
        """What its class means for the user's training, beyond the class's name (None: nothing more)."""
        return None

    def apply(self, applied: Applied) -> None:
        """Configure the backend in the child, before the script runs (source actions were applied to a copy)."""
