"""The parallelism plans a `tune --nproc N` measured, each with what it did to memory per rank (measured here)
and, with `--target SLICE`, ranked for the slice by projection.

Why: on a CPU host the time of another mesh, of resharding or of checkpointing does not transfer to a TPU slice
(gloo between processes is not ICI; the CPU's compute is not the chip's). Those times are measured and said to be
this host's; the order for the slice comes from the projection (run/projection.py's projector), labelled an
estimate, and no row is ever a verified TPU speedup. Memory per rank is measured: each rank's in-step peak
(backend/core/memory.py's StepPeak), baseline against plan, medians over the trial's pairs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pydantic import BaseModel, Field

from tpu_agent.measure.compare import shown_bytes
from tpu_agent.plan.actions import ActivationCheckpointing, FsdpParamDtype, FsdpReshard, MeshShape, Plan
from tpu_agent.projection.rank import ProjectedPlan, SlicePlan, SliceRanking, order_key
from tpu_agent.propose.parallel import slice_plan

if TYPE_CHECKING:
    from tpu_agent.search.records import TrialRecord

PARALLELISM = (MeshShape, FsdpReshard, FsdpParamDtype, ActivationCheckpointing)
MAX_NEW_PROJECTIONS = 6  # beyond the slice ranking's own: each one a child process (seconds to minutes)


class MeasuredPlan(BaseModel):
    """One measured parallelism plan: this host's figures (measured) and the slice's (projected)."""

    trial: int | None = Field(description="the search's trial; None: the action alone, measured after the search")
    plan: Plan
    state: str = Field(description="the trial's state (complete, numerics, pruned), or alone, or failed")
    speedup_here: float | None = Field(None, description="measured on this host's ranks: the baseline's step time / "
                                       "the plan's (search median); not a TPU slice's")
    rank_memory: list[tuple[int, int]] | None = Field(None, description="measured: each rank's in-step peak device "
                                                      "bytes, (baseline, plan), medians over the trial's pairs")
    slice_plan: SlicePlan | None = Field(None, description="the plan's point in the projection's space")
    projected: ProjectedPlan | None = Field(None, description="its projection for the slice (estimates)")
    note: str | None = None

    def memory_text(self) -> str:
        return per_rank_text(self.rank_memory) if self.rank_memory else "not measured"


class MeasuredParallelism(BaseModel):
    """Every parallelism plan the tune measured; ranked by projection for `slice` when there is one."""

    world_size: int
    host: str = Field(description="where the times were measured, in words")
    slice: str | None = None
    label: str | None = Field(None, description='"projected for <slice>": the projected columns are estimates')
    verified: bool = Field(False, description="always false for the slice: a projection is never verified")
    plans: list[MeasuredPlan] = Field(default_factory=list, description="best projected first with a slice, else "
                                      "in trial order")
    notes: list[str] = Field(default_factory=list)


def per_rank_text(rank_memory: list[tuple[int, int]], side: int = 1) -> str:
    """Each rank's bytes, (baseline, plan) pairs: side 1 the plan's against the baseline ('rank 0 1.69 MiB
    (+7.1%), rank 1 ...'), side 0 the baseline's alone."""
    return ", ".join(f"rank {r} {shown_bytes(pair[side])}" + (f" ({pair[1] / pair[0] - 1:+.1%})"
                                                            if side and pair[0] else "")
                     for r, pair in enumerate(rank_memory))


def is_parallelism(plan: Plan) -> bool:
    return any(isinstance(a, PARALLELISM) for a in plan.actions)


def measured_plans(trials: list[TrialRecord], world_size: int, host: str) -> MeasuredParallelism | None:
    """The measured trials whose plan changes the parallelism; None when there are none."""
    rows = [MeasuredPlan(trial=t.number, plan=t.plan, state=t.state.value, speedup_here=t.speedup,
                         rank_memory=t.rank_memory)
            for t in trials if is_parallelism(t.plan) and t.state.value in ("complete", "numerics", "pruned")
            and (t.speedup is not None or t.rank_memory)]
    return MeasuredParallelism(world_size=world_size, host=host, plans=rows) if rows else None


def point_for(plan: Plan, chips: int, slices: int = 1) -> tuple[SlicePlan, str | None]:
    """The plan on a slice of `chips` (each of `slices` such, data parallel across them): its tensor-parallel degree
    kept, FSDP over the other chips, checkpointing as the plan says; a note where the projection does not model
    part of the plan."""
    point = slice_plan(plan, chips) or SlicePlan(mesh={"fsdp": chips}, per_chip_batch=None)
    tensor = point.mesh.get("tensor", 1)
    notes = []
    if chips % tensor:
        notes.append(f"tp {tensor} does not divide the slice's {chips} chips: projected without a tensor axis")
        tensor = 1
    mesh = {a: n for a, n in (("data", slices), ("fsdp", chips // tensor), ("tensor", tensor)) if n > 1} or {"fsdp": 1}
    unmodelled = [a.describe() for a in plan.actions if isinstance(a, (FsdpReshard, FsdpParamDtype))]
    if unmodelled:
        notes.append(f"{', '.join(unmodelled)}: not in the projection's model (projected as the script's own)")
    partial = [a for a in plan.actions if isinstance(a, ActivationCheckpointing) and a.every > 1]
    if partial:
        notes.append(f"{partial[0].describe()}: projected as every block (the projection's space)")
    others = [a.describe() for a in plan.actions if not isinstance(a, PARALLELISM)]
    if others:
        notes.append(f"not projected: {', '.join(others)} (this host's execution)")
    return point.model_copy(update={"mesh": mesh}), "; ".join(notes) or None


def rank_for_slice(measured: MeasuredParallelism, ranking: SliceRanking,
                   project: Callable[[SlicePlan], tuple[ProjectedPlan, int | None]],
                   say: Callable[[str], None] = lambda line: None) -> MeasuredParallelism:
    """Each measured plan's projection for the ranking's slice (one already projected is reused), then the plans
    ordered by it: fitting plans by projected step time per sample, then the rest."""
    known = {p.plan.key(): p for p in [ranking.before, *ranking.ranked] if p.error is None}
    new = 0
    rows, notes = [], list(measured.notes)
    for row in measured.plans:
        point, note = point_for(row.plan, ranking.chips // ranking.slices, ranking.slices)
        projected = known.get(point.key())
        if projected is None and new < MAX_NEW_PROJECTIONS:
            projected, _ = project(point)
            new += 1
            known[point.key()] = projected
            which = f"trial {row.trial}'s" if row.trial is not None else "alone:"
            say(f"projection ({ranking.label}): {which} {row.plan.describe()} as {point.describe()}: "
                + ("failed: " + projected.error if projected.error else
                   f"step {projected.step_s * 1e3:.4g} ms (estimate)"))
        elif projected is None:
            note = "; ".join(filter(None, [note, f"not projected: the budget of {MAX_NEW_PROJECTIONS} was spent"]))
        rows.append(row.model_copy(update={"slice_plan": point, "projected": projected, "note": note}))
    rows.sort(key=lambda r: order_key(r.projected) if r.projected is not None else (3, 0.0))
    return measured.model_copy(update={"slice": ranking.slice, "label": ranking.label, "plans": rows,
                                       "notes": notes})
