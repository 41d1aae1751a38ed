"""`Plan`: the changes a trial applies, as data (saved as plan.json).

A plan is a list of actions. Each action class owns what the rest of the tool
asks of its kind: its `group` (what an ablation credits), its one-line
`describe()`, the `instruction()` a person follows to get it without
tpu-agent, how it is applied in the child at run time (`apply`), and the
field hint the Claude proposer is shown (the base class: action_base.py). Adding a kind is one class
here or in distributed_actions.py (a torch.distributed script's own calls), named in ACTION_CLASSES.

Each action says whether it preserves numerics (the same per-step losses
within float32 summation-order noise); the verifier holds those to the
baseline's losses and the others to a loss tolerance. Source changes happen
only through `PadDim`, on a copy of the user's script; everything else is
applied at run time by the backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tpu_agent.paths import write_atomic
from tpu_agent.plan.action_base import EFFECTS, ActionBase, Group
from tpu_agent.plan.applied import Applied
from tpu_agent.plan.distributed_actions import ActivationCheckpointing, FsdpParamDtype, FsdpReshard, MeshShape

SCHEMA_VERSION = 1
MeshAxes = dict[str, int]


class PadDim(ActionBase):
    """Rewrite one integer literal of the user's source (a tensor dim) to a padded value."""

    group: ClassVar[Group] = "padding"
    single: ClassVar[bool] = False
    hint: ClassVar[str] = "{knob, choices.new} (rewrites that integer literal)"
    kind: Literal["pad_dim"] = "pad_dim"
    file: str  # relative to the script's directory
    line: int = Field(ge=1)
    column: int = Field(ge=0)
    old: int
    new: int
    name: str | None = None  # the variable it is assigned to, for reports
    effect: Literal["model", "training", "data"] = "model"  # the knob finder's reading of the literal
    batch: bool = False  # it sets the batch size: time is compared per sample

    @model_validator(mode="after")
    def _grows(self):
        if self.new <= 0 or self.old <= 0:
            raise ValueError("pad_dim values must be positive")
        return self

    def describe(self) -> str:
        return f"{self.name or 'literal'} {self.old}->{self.new} ({self.file}:{self.line})"


class PadOps(ActionBase):
    """The backend zero-pads matmul/convolution operand dims to a multiple and slices results: every dim, or only
    dims of the target `sizes` (the vocabulary dim of an LM head, say)."""

    group: ClassVar[Group] = "padding"
    effect: Literal["exact"] = "exact"
    hint: ClassVar[str] = "{multiple, sizes (optional: only dims of these sizes are padded)}"
    kind: Literal["pad_ops"] = "pad_ops"
    multiple: int = Field(128, ge=2, le=1024)
    sizes: tuple[int, ...] = Field((), description="only dims of these sizes (empty: every dim)")

    @field_validator("sizes")
    @classmethod
    def _sorted(cls, sizes):
        if any(s < 2 for s in sizes):
            raise ValueError("pad_ops sizes must be >= 2")
        return tuple(sorted(set(sizes)))

    def describe(self) -> str:
        sizes = f',"sizes":{json.dumps(list(self.sizes), separators=(",", ":"))}' if self.sizes else ""
        return f'pad_ops {{"multiple":{self.multiple}{sizes}}}'

    def instruction(self) -> str:
        target = f":{','.join(map(str, self.sizes))}" if self.sizes else ""
        return f"operand padding: `TPU_AGENT_PAD_OPS={self.multiple}{target}`"

    def apply(self, applied: Applied) -> None:
        from tpu_agent.backend.core import padding

        padding.set_multiple(self.multiple, self.sizes)
        only = f" (dims of size {', '.join(map(str, self.sizes))} only)" if self.sizes else ""
        applied.notes.append(f"matmul operands padded to multiples of {self.multiple}{only}")


class PadBatch(ActionBase):
    """Batches padded where they leave the DataLoader, along `dim`, to the smallest of a few lengths: the step then
    compiles once per bucket instead of once per batch length. Each listed tensor is padded with its value (the
    pad id, -100 for labels, 0 for a mask): the values the script's own collate pads with."""

    group: ClassVar[Group] = "padding"
    hint: ClassVar[str] = "{dim, buckets (ascending lengths), values ({tensor path: pad value})}"
    kind: Literal["pad_batch"] = "pad_batch"
    dim: int = Field(1, ge=1)
    buckets: tuple[int, ...] = Field(description="ascending; a longer batch pads to a multiple of the last")
    values: dict[str, float] = Field(description="the tensors padded, by their path in the batch, and their pad value")
    masked: bool = Field(True, description="the pad values are the script's own, so the padded positions are left "
                         "out of the loss as its own padding is (exact: verification holds the losses to the "
                         "baseline's); false: they may count (training)")
    effect: Literal["exact", "training"] = "exact"

    effect_from: ClassVar = ("masked", lambda masked: "exact" if masked else "training")

    @field_validator("buckets")
    @classmethod
    def _ascending(cls, buckets):
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError("pad_batch buckets must be ascending positive lengths")
        return tuple(buckets)

    @model_validator(mode="after")
    def _has_values(self):
        if not self.values:
            raise ValueError("pad_batch needs at least one tensor to pad")
        return self

    def target(self, length: int) -> int:
        """The length a batch of `length` is padded to."""
        for b in self.buckets:
            if length <= b:
                return b
        last = self.buckets[-1]
        return -(-length // last) * last

    def describe(self) -> str:
        how = f"to {self.buckets[0]}" if len(self.buckets) == 1 else f"to buckets {list(self.buckets)}"
        return f"batch dim {self.dim} padded {how} ({', '.join(self.values)})"

    def instruction(self) -> str:
        if len(self.buckets) == 1:
            return (f"fixed-length batches: pad dim {self.dim} to {self.buckets[0]} in the collate function "
                    f"(tokenizer: `padding=\"max_length\", max_length={self.buckets[0]}`)")
        return (f"bucketed batches: pad dim {self.dim} up to the next of {list(self.buckets)} in the collate "
                "function (or `pad_to_multiple_of=` for even steps)")

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.batches import pad_batches

        pad_batches(self)
        applied.notes.append(f"{self.describe()}, as batches leave the DataLoader")


class Mesh(ActionBase):
    """A device mesh over the available devices, e.g. {"data": 4} or {"data": 2, "model": 2}."""

    group: ClassVar[Group] = "sharding"
    effect: Literal["exact"] = "exact"
    hint: ClassVar[str] = "{axes: {name: size}}"
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

    def instruction(self) -> str:
        return f"mesh: `torch.tpu.sharding.set_mesh({dict(self.axes)})`"

    def apply(self, applied: Applied) -> None:
        applied.mesh = dict(self.axes)  # placed on the model the script builds, at its first forward


class ShardRule(ActionBase):
    """Parameters whose name matches the glob `pattern` are split with this PartitionSpec."""

    group: ClassVar[Group] = "sharding"
    effect: Literal["exact"] = "exact"
    single: ClassVar[bool] = False
    hint: ClassVar[str] = "{pattern (glob over parameter names), spec (list of mesh axis names or null per dim)}"
    kind: Literal["shard_rule"] = "shard_rule"
    pattern: str
    spec: tuple[str | None, ...]

    def instruction(self) -> str:
        return f"sharding: `torch.tpu.sharding.shard_module(model, [({self.pattern!r}, {tuple(self.spec)})])`"

    def apply(self, applied: Applied) -> None:
        applied.rules.append((self.pattern, tuple(self.spec)))


class BatchSharding(ActionBase):
    """The model's tensor inputs are split along dim 0 over mesh axis `axis` (data parallel)."""

    group: ClassVar[Group] = "sharding"
    effect: Literal["exact"] = "exact"
    hint: ClassVar[str] = "{axis}"
    kind: Literal["batch_sharding"] = "batch_sharding"
    axis: str = "data"

    def instruction(self) -> str:
        return f"batch split: `torch.tpu.sharding.shard_batches(model, {self.axis!r})`"

    def apply(self, applied: Applied) -> None:
        applied.batch_axis = self.axis


class Compile(ActionBase):
    """How the step executes: op by op, fused at sync points, or compiled as one program."""

    group: ClassVar[Group] = "execution"
    effect: Literal["exact", "numerics"] = "exact"
    hint: ClassVar[str] = "{mode: eager|fused|compiled}"
    kind: Literal["compile"] = "compile"
    mode: Literal["eager", "fused", "compiled"]

    # Both are the same math in another order, so other rounding, not exact. Compiled steps take the
    # backward XLA derives from the forward and run the whole step as XLA programs (since c183037 and
    # e7d77d3 about 2e-7 relative off eager's losses over 20 AdamW steps). Fused execution runs the recorded
    # ops as one XLA program, which fuses and reorders what eager ran op by op: on examples/odd_shapes.py its
    # losses drift 2.01e-05 relative from eager's (at step 16 of 22), past the exact check's 1e-05, every run.
    effect_from: ClassVar = ("mode", lambda mode: "exact" if mode == "eager" else "numerics")

    def instruction(self) -> str | None:
        if self.mode == "fused":
            return ("fused execution: `TORCH_TPU_DEFER_AND_FUSE=1`, or "
                    "`with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):` around the loop")
        if self.mode == "compiled":
            return ("compiled steps: `TPU_AGENT_COMPILE_STEPS=1`, or `torch.tpu.compile_steps()` before the loop "
                    "(the model's forward and backward, and each optimizer's update, as XLA programs)")
        return None

    def apply(self, applied: Applied) -> None:
        from tpu_agent.backend.core import modes

        if self.mode in ("fused", "compiled"):
            modes.set_mode(modes.EagerMode.DEFER_AND_FUSE)
            applied.notes.append("fused execution (DEFER_AND_FUSE)" if self.mode == "fused" else
                                 "compiled steps (the model's forward and backward programs, each optimizer's "
                                 "update as one program; the rest of the step fused)")
        applied.compile_model = self.mode == "compiled"


class MatmulPrecision(ActionBase):
    """Matmul precision: `default` is one bf16 pass on TPUs; `highest` is full float32."""

    group: ClassVar[Group] = "precision"
    hint: ClassVar[str] = "{precision: default|high|highest}"
    kind: Literal["matmul_precision"] = "matmul_precision"
    precision: Literal["default", "high", "highest"]
    effect: Literal["exact", "numerics"] = "numerics"

    effect_from: ClassVar = ("precision", lambda precision: "exact" if precision == "highest" else "numerics")

    def instruction(self) -> str:
        return f"matmul precision: `with torch.tpu.precision(torch.tpu.Precision.{self.precision.upper()}):`"

    def apply(self, applied: Applied) -> None:
        from tpu_agent.backend.core import modes

        modes.set_precision(modes.Precision[self.precision.upper()])
        applied.notes.append(f"matmul precision {self.precision}")


class ExpertsImplementation(ActionBase):
    """A Hugging Face MoE's experts computed with static shapes instead of a Python loop over the experts hit:
    the loop's `torch.where` gives each expert a token count that changes every step, so on XLA each count is
    a new program. `grouped_mm` sorts the tokens by expert and multiplies in one grouped matmul; `batched_mm`
    gathers each token's expert weights. No token is dropped (not capacity padding, which would be a change of
    the model): the same math, summed in another order."""

    group: ClassVar[Group] = "execution"
    hint: ClassVar[str] = "{implementation: grouped_mm|batched_mm}"
    kind: Literal["experts_implementation"] = "experts_implementation"
    implementation: Literal["grouped_mm", "batched_mm"]
    effect: Literal["numerics"] = "numerics"

    def describe(self) -> str:
        return f"MoE experts as {self.implementation} (static shapes, no expert loop)"

    def instruction(self) -> str:
        return (f"`model.set_experts_implementation(\"{self.implementation}\")` after building the model, or "
                f"`experts_implementation=\"{self.implementation}\"` in its config or `from_pretrained`")

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.experts import use_experts_implementation

        use_experts_implementation(self.implementation, applied)


class ExpertCapacity(ActionBase):
    """A script's own MoE block (a router, a list of experts and a loop picking each expert's tokens with
    `torch.where`, as in Mixtral's code) run with capacity padding: each expert takes a fixed number of slots, so
    no shape depends on the routing. `capacity_factor` null: room for every token in every expert, none dropped,
    the empty slots never reach a token (exact; the experts compute experts / top_k times the loop's rows); a
    factor: ceil(factor * tokens * top_k / experts) slots, the tokens over them losing that expert (training)."""

    group: ClassVar[Group] = "padding"
    hint: ClassVar[str] = "{capacity_factor: null (every token, none dropped) or a number (slots per expert in " \
                          "units of tokens * top_k / experts; tokens over it are dropped)}"
    kind: Literal["expert_capacity"] = "expert_capacity"
    capacity_factor: float | None = Field(None, gt=0, le=64)
    effect: Literal["exact", "training"] = "exact"

    effect_from: ClassVar = ("capacity_factor", lambda factor: "exact" if factor is None else "training")

    def describe(self) -> str:
        how = "every token" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}"
        return f"MoE experts capacity-padded ({how})"

    def effect_note(self) -> str | None:
        if self.capacity_factor is None:
            return "no token is dropped and the empty slots reach no token; the losses were held to the baseline's"
        return ("a token routed to an expert past its slots loses that expert's output (its residual carries it), "
                "so training changes; the losses were held to the loss tolerance (--loss-tol)")

    def instruction(self) -> str:
        size = ("as many slots as the batch has tokens (none is dropped)" if self.capacity_factor is None else
                f"ceil({self.capacity_factor:g} * tokens * top_k / experts) slots")
        return (f"capacity padding in the MoE block's forward: give each expert {size}, place its tokens in "
                "them in token order (a cumulative sum over the one-hot routing), run each expert on all its slots "
                "and gather each token's outputs back with its routing weights, instead of the `torch.where` loop "
                "(what `tpu_agent.plan.capacity.dispatch` computes)")

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.capacity import use_expert_capacity

        use_expert_capacity(self.capacity_factor, applied)


ACTION_CLASSES: tuple[type[ActionBase], ...] = (PadDim, PadOps, PadBatch, Mesh, ShardRule, BatchSharding, Compile,
                                                 MatmulPrecision, ExpertsImplementation, ExpertCapacity,
                                                 FsdpReshard, FsdpParamDtype, ActivationCheckpointing, MeshShape)
Action = Annotated[Union[ACTION_CLASSES], Field(discriminator="kind")]  # noqa: UP007 - a tuple of classes
ACTION_MODELS: dict[str, type[ActionBase]] = {cls.model_fields["kind"].default: cls for cls in ACTION_CLASSES}
ACTION_KINDS: tuple[str, ...] = tuple(ACTION_MODELS)
ActionKind = Literal[ACTION_KINDS]  # type: ignore[valid-type]
GROUPS: dict[str, Group] = {kind: cls.group for kind, cls in ACTION_MODELS.items()}


def unit_of(action) -> str:
    """`padding`, or `padding (model)` for an action that is not exact: the ablation's unit."""
    return action.group if action.effect == "exact" else f"{action.group} ({action.effect})"


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    actions: list[Action] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self):
        for kind, cls in ACTION_MODELS.items():
            if cls.single and sum(a.kind == kind for a in self.actions) > 1:
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

    def effects(self) -> list[str]:
        """The classes of its actions, in EFFECTS order."""
        present = {a.effect for a in self.actions}
        return [e for e in EFFECTS if e in present]

    def of(self, cls):
        return [a for a in self.actions if isinstance(a, cls)]

    def units(self) -> dict[str, list]:
        """Its actions by what an ablation weighs on its own: the group, split by effect (padding that changes
        the model apart from padding that does not), in the order they first appear."""
        out: dict[str, list] = {}
        for action in self.actions:
            out.setdefault(unit_of(action), []).append(action)
        return out

    def describe(self) -> str:
        return "; ".join(a.describe() for a in self.actions) if self.actions else "(no change)"

    def key(self) -> str:
        """A canonical text: two plans with the same actions have the same key."""
        # without the classes: the same change has the same key in studies recorded before they existed
        items = sorted(json.dumps(a.model_dump(exclude={"effect", "batch"}), sort_keys=True) for a in self.actions)
        return json.dumps(items)

    def save(self, path: Path) -> None:
        write_atomic(path, self.model_dump_json(indent=2) + "\n", "the plan")
