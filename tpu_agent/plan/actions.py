"""`Plan`: the changes a trial applies, as data (saved as plan.json).

A plan is a list of actions. Each action says whether it preserves numerics
(the same per-step losses within float32 summation-order noise); the
verifier holds those to the baseline's losses and the others to a loss
tolerance. Source changes happen only through `PadDim`, on a copy of the
user's script; everything else is applied at run time by the backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMA_VERSION = 1
MeshAxes = dict[str, int]


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def preserves_numerics(self) -> bool:
        raise NotImplementedError


class PadDim(_Action):
    """Rewrite one integer literal of the user's source (a tensor dim) to a padded value."""

    kind: Literal["pad_dim"] = "pad_dim"
    file: str  # relative to the script's directory
    line: int = Field(ge=1)
    column: int = Field(ge=0)
    old: int
    new: int
    name: str | None = None  # the variable it is assigned to, for reports

    @property
    def preserves_numerics(self) -> bool:
        return False  # a bigger layer or batch is a different model or batch

    @model_validator(mode="after")
    def _grows(self):
        if self.new <= 0 or self.old <= 0:
            raise ValueError("pad_dim values must be positive")
        return self


class PadOps(_Action):
    """The backend zero-pads matmul/convolution operand dims to a multiple and slices results."""

    kind: Literal["pad_ops"] = "pad_ops"
    multiple: int = Field(128, ge=2, le=1024)

    @property
    def preserves_numerics(self) -> bool:
        return True


class Mesh(_Action):
    """A device mesh over the available devices, e.g. {"data": 4} or {"data": 2, "model": 2}."""

    kind: Literal["mesh"] = "mesh"
    axes: MeshAxes

    @field_validator("axes")
    @classmethod
    def _positive(cls, axes):
        if not axes or any(size < 1 for size in axes.values()):
            raise ValueError("mesh axes need positive sizes")
        return axes

    @property
    def devices(self) -> int:
        size = 1
        for v in self.axes.values():
            size *= v
        return size

    @property
    def preserves_numerics(self) -> bool:
        return True


class ShardRule(_Action):
    """Parameters whose name matches the glob `pattern` are split with this PartitionSpec."""

    kind: Literal["shard_rule"] = "shard_rule"
    pattern: str
    spec: tuple[str | None, ...]

    @property
    def preserves_numerics(self) -> bool:
        return True


class BatchSharding(_Action):
    """The model's tensor inputs are split along dim 0 over mesh axis `axis` (data parallel)."""

    kind: Literal["batch_sharding"] = "batch_sharding"
    axis: str = "data"

    @property
    def preserves_numerics(self) -> bool:
        return True


class Compile(_Action):
    """How the step executes: op by op, fused at sync points, or compiled as one program."""

    kind: Literal["compile"] = "compile"
    mode: Literal["eager", "fused", "compiled"]

    @property
    def preserves_numerics(self) -> bool:
        return True


class MatmulPrecision(_Action):
    """Matmul precision: `default` is one bf16 pass on TPUs; `highest` is full float32."""

    kind: Literal["matmul_precision"] = "matmul_precision"
    precision: Literal["default", "high", "highest"]

    @property
    def preserves_numerics(self) -> bool:
        return self.precision == "highest"


Action = Annotated[
    Union[PadDim, PadOps, Mesh, ShardRule, BatchSharding, Compile, MatmulPrecision],
    Field(discriminator="kind"),
]
ACTION_KINDS = ("pad_dim", "pad_ops", "mesh", "shard_rule", "batch_sharding", "compile", "matmul_precision")


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    actions: list[Action] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self):
        singles = ("pad_ops", "mesh", "batch_sharding", "compile", "matmul_precision")
        for kind in singles:
            if sum(a.kind == kind for a in self.actions) > 1:
                raise ValueError(f"a plan has at most one {kind} action")
        seen = set()
        for a in self.actions:
            if isinstance(a, PadDim):
                where = (a.file, a.line, a.column)
                if where in seen:
                    raise ValueError(f"two pad_dim actions rewrite {a.file}:{a.line}:{a.column}")
                seen.add(where)
        mesh = self.mesh
        needs_mesh = [a.kind for a in self.actions if isinstance(a, (ShardRule, BatchSharding))]
        if needs_mesh and mesh is None:
            raise ValueError(f"{needs_mesh[0]} needs a mesh action")
        if mesh is not None:
            for a in self.actions:
                axes = [a.axis] if isinstance(a, BatchSharding) else (
                    [n for entry in a.spec if entry is not None for n in (entry,)] if isinstance(a, ShardRule) else [])
                for name in axes:
                    if name not in mesh.axes:
                        raise ValueError(f"{a.kind} uses mesh axis {name!r}; the mesh has {sorted(mesh.axes)}")
        return self

    @property
    def mesh(self) -> Mesh | None:
        return next((a for a in self.actions if isinstance(a, Mesh)), None)

    @property
    def preserves_numerics(self) -> bool:
        return all(a.preserves_numerics for a in self.actions)

    def of(self, cls):
        return [a for a in self.actions if isinstance(a, cls)]

    def key(self) -> str:
        """A canonical text: two plans with the same actions have the same key."""
        items = sorted(json.dumps(a.model_dump(), sort_keys=True) for a in self.actions)
        return json.dumps(items)

    def save(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Plan":
        return cls.model_validate_json(Path(path).read_text())
