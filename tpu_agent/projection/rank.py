"""Plans for a TPU slice that is not attached, ranked by projection: mesh shape, per-chip batch, checkpointing.

`tpu-agent tune --target v6e-256` on a host without that slice cannot measure a plan there; it can project one
(the step traced on meta, partitioned by XLA for the slice's chips, costed per generation: a Projector, which
tpu_agent.run.projection.projector makes, each projection in a child process). Every plan here is an estimate,
labelled "projected for <slice>", and none is ever verified: the tuner's verdicts come from measurements only.

The space: every factorisation of the chip count into the mesh axes data x fsdp x tensor (tensor only in sizes
that divide the dims a tensor-parallel split cuts: the repeated blocks' Linear widths), a per-chip batch of 1 to
MAX_PER_CHIP_BATCH (powers of two), and activation checkpointing of the repeated blocks on or off. A projection
costs seconds (a tiny model) to minutes (8B), so the space is not projected whole: a best-first search from FSDP
over every chip projects the neighbours of the best plan so far (one factor moved between two mesh axes, the
batch doubled or halved, checkpointing switched) until none is better or MAX_PROJECTIONS are spent. Plans are
compared by projected step time per sample (step time / global batch: the step time itself among plans of one
batch) among those that fit in HBM per chip; a plan that does not fit is never chosen, though the search expands
one that is faster than the best that fits (checkpointing next to it may make it fit).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Literal

from pydantic import BaseModel, Field

from tpu_agent.errors import TpuAgentError
from tpu_agent.slices import Slice

AXES = ("data", "fsdp", "tensor")  # outermost first: the tensor axis on the nearest chips (mesh row-major over ids)
MAX_PROJECTIONS = 10  # traces (a projector that shares traces re-costs more plans for free), the before plan included
MAX_PER_CHIP_BATCH = 64


class SlicePlan(BaseModel):
    """One point of the space: what a projection is asked for."""

    mesh: dict[str, int]
    per_chip_batch: int | None = Field(description="None: the script's own batch, as written")
    checkpoint: bool = Field(False, description="every repeated block checkpointed by the tool (else as the script)")

    def key(self) -> tuple:
        return tuple(sorted(self.mesh.items())), self.per_chip_batch, self.checkpoint

    def describe(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh.items())
        batch = "the script's batch" if self.per_chip_batch is None else f"per-chip batch {self.per_chip_batch}"
        return f"mesh {mesh}, {batch}, checkpointing {'every block' if self.checkpoint else 'as the script'}"


class ProjectedPlan(BaseModel):
    """A plan's projection (estimates, never measured) or why it has none."""

    estimate: Literal[True] = Field(True, description="always true: projected by a model, never measured")
    plan: SlicePlan
    global_batch: int | None = None
    step_s: float | None = None
    time_per_sample_s: float | None = None
    mfu: float | None = None
    memory_per_chip_bytes: float | None = None
    hbm_bytes: float | None = None
    fits: bool = False
    exposed_collective_s: float | None = None
    host_offload_bytes_per_chip: float | None = None
    assumptions: list[str] = Field(default_factory=list, description="the cost model's assumptions for this projection")
    dcn_s: float = Field(0.0, description="collectives across slices over the data-center network (multislice)")
    recosted_from: dict[str, int] | None = Field(None, description="re-costed from the trace on this in-slice mesh "
                                                 "(the same per-chip work, another data x fsdp split); None: traced")
    error: str | None = None

    @property
    def margin_bytes(self) -> float | None:
        """HBM left per chip (negative: over by that much)."""
        if self.memory_per_chip_bytes is None or self.hbm_bytes is None:
            return None
        return self.hbm_bytes - self.memory_per_chip_bytes


class SliceRanking(BaseModel):
    """What the tuner reports for a slice: the plan as written, the best projected plan, every projection ranked."""

    estimate: Literal[True] = Field(True, description="always true: every figure here is projected, never measured")
    slice: str
    chips: int
    label: str = Field(description='"projected for <slice>": every figure here is an estimate')
    verified: bool = Field(False, description="always false: a plan chosen by projection is never verified")
    before: ProjectedPlan = Field(description="the script as written, FSDP over every chip (the default placement)")
    after: ProjectedPlan | None = Field(None, description="the fastest per sample of the plans that fit (None: none)")
    ranked: list[ProjectedPlan] = Field(description="every plan projected, best first (fitting before not fitting)")
    meshes: int = Field(description="mesh shapes the chip count and the model's dims allow")
    candidates: int = Field(description="plans in the space: meshes x per-chip batches x checkpointing")
    projections: int = Field(description="plans projected, the before plan included")
    traces: int = Field(0, description="steps traced and partitioned (at most the budget): what the ranking cost; the "
                        "other plans were re-costed from one of them")
    slices: int = Field(1, description="slices joined by DCN (multislice); chips counts all of them")
    seconds: float = Field(description="measured: wall time of all the projections")
    notes: list[str] = Field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_sizes(chips: int, dims: list[int] | None) -> list[int]:
    """Tensor-axis sizes the model's dims allow: divisors of the chip count that divide every dim a tensor split
    cuts (no dims known: none past 1)."""
    if not dims:
        return [1]
    common = math.gcd(*dims)
    return [t for t in _divisors(chips) if common % t == 0]


def meshes(chips: int, tensor_dims: list[int] | None = None, slices: int = 1) -> list[dict[str, int]]:
    """Every data x fsdp x tensor factorisation of a slice's `chips` the dims allow, the data axis also spanning the
    `slices` (multislice: data parallel across them over DCN); axes of size 1 left out."""
    out = []
    for tensor in tensor_sizes(chips, tensor_dims):
        for data in _divisors(chips // tensor):
            out.append(_mesh(data * slices, chips // tensor // data, tensor))
    return out


def _mesh(data: int, fsdp: int, tensor: int) -> dict[str, int]:
    mesh = {a: n for a, n in zip(AXES, (data, fsdp, tensor)) if n > 1}
    return mesh or {"fsdp": 1}


def _sizes(mesh: dict[str, int]) -> tuple[int, int, int]:
    return tuple(mesh.get(a, 1) for a in AXES)  # type: ignore[return-value]


def neighbours(plan: SlicePlan, allowed: list[dict[str, int]], blocks: bool) -> list[SlicePlan]:
    """One step away: checkpointing switched (the memory lever), the batch doubled, a prime factor moved between
    two mesh axes, the batch halved. The order matters only where the budget ends inside a round."""
    out = [plan.model_copy(update={"checkpoint": not plan.checkpoint})] if blocks else []
    b = plan.per_chip_batch  # None: the script's batch, which cannot be changed
    if b is not None and b * 2 <= MAX_PER_CHIP_BATCH:
        out.append(plan.model_copy(update={"per_chip_batch": b * 2}))
    keys = {tuple(sorted(m.items())) for m in allowed}
    sizes = _sizes(plan.mesh)
    for i, j in ((1, 0), (1, 2), (0, 1), (2, 1), (0, 2), (2, 0)):
        if sizes[i] == 1:
            continue
        p = min(d for d in _divisors(sizes[i]) if d > 1)
        moved = list(sizes)
        moved[i], moved[j] = sizes[i] // p, sizes[j] * p
        mesh = _mesh(*moved)
        if tuple(sorted(mesh.items())) in keys:
            out.append(plan.model_copy(update={"mesh": mesh}))
    if b is not None and b > 1:
        out.append(plan.model_copy(update={"per_chip_batch": b // 2}))
    return out


def order_key(p: ProjectedPlan) -> tuple:
    """Best first: fitting plans by time per sample (then memory per chip), then plans that do not fit by memory,
    then failures."""
    if p.error is not None or p.step_s is None:
        return (2, 0.0)
    if not p.fits:
        return (1, p.memory_per_chip_bytes or math.inf)
    return (0, _cost(p), p.memory_per_chip_bytes or 0.0)  # of equal time (data x fsdp splits whose collectives
    # hide under compute), the one that leaves most HBM free


def _cost(p: ProjectedPlan) -> float:
    """Step time per sample; the step time where the global batch is unknown (every such plan runs the script's
    own batch, and the search never mixes the two: see rank)."""
    return p.time_per_sample_s if p.time_per_sample_s is not None else p.step_s


def best_fitting(projected: list[ProjectedPlan]) -> ProjectedPlan | None:
    """The fastest per sample among the plans that fit per chip (of equal time, the least memory); None when none
    fits."""
    fitting = [p for p in projected if p.error is None and p.fits and p.step_s is not None]
    return min(fitting, key=order_key) if fitting else None


Projector = Callable[[SlicePlan], tuple[ProjectedPlan, int | None]]  # a plan's projection, the blocks_total


def _traces(project, projections: int) -> int:
    """What the ranking has cost: the projector's traces where it shares them, else one per projection."""
    return getattr(project, "traces", projections)


def rank(sl: Slice, project: Projector, tensor_dims: list[int] | None = None, script_batch: int | None = None,
         budget: int = MAX_PROJECTIONS, say: Callable[[str], None] = lambda line: None,
         keep: Callable[[SliceRanking], None] = lambda ranking: None) -> SliceRanking:
    """The before plan (the script as written, FSDP over every chip of a slice, data across slices), then the
    best-first search within `budget` traces (the before plan's counted). `script_batch`: the script's global batch,
    where known. `keep` gets the ranking so far after each projection (an interrupted tune keeps what was
    projected). A projector with `free(plan)` (run.projection.SliceProjector) re-costs the plans that share a trace
    already made: every data x fsdp split of a traced plan is ranked with it, at no further trace."""
    t0 = time.perf_counter()
    allowed = meshes(sl.chips, tensor_dims, sl.slices)
    label = f"projected for {sl.name}"
    fsdp = _mesh(sl.slices, sl.chips, 1)
    before, blocks_total = project(SlicePlan(mesh=fsdp, per_chip_batch=None))
    say(f"projection ({label}): the script as written, {before.plan.describe()}: {_short(before)}")
    if before.error is not None:
        raise TpuAgentError(f"the script as written cannot be projected for {sl.name}: {before.error}")
    blocks, notes, count = bool(blocks_total), [], 1
    total = sl.chips * sl.slices
    per_chip = script_batch // total if script_batch and script_batch % total == 0 else None
    start = SlicePlan(mesh=fsdp, per_chip_batch=min(per_chip or 1, MAX_PER_CHIP_BATCH))
    done: dict[tuple, ProjectedPlan] = {}
    free = getattr(project, "free", None)

    def ranking(extra: list[str]) -> SliceRanking:
        ranked = sorted(done.values(), key=order_key)
        batches = 1 if start.per_chip_batch is None else int(math.log2(MAX_PER_CHIP_BATCH)) + 1
        return SliceRanking(slice=sl.name, chips=total, slices=sl.slices, label=label, before=before,
                            after=best_fitting(ranked), ranked=ranked, meshes=len(allowed), projections=count,
                            traces=_traces(project, count), notes=notes + extra,
                            candidates=len(allowed) * batches * (2 if blocks else 1),
                            seconds=time.perf_counter() - t0)

    def one(plan: SlicePlan) -> ProjectedPlan:
        nonlocal count
        done[plan.key()], _ = project(plan)
        count += 1
        return done[plan.key()]

    def siblings(plan: SlicePlan) -> None:
        """The other data x fsdp splits of the plan's trace, re-costed from it (a projector that shares traces)."""
        if free is None or done[plan.key()].error is not None:
            return
        found = [plan.model_copy(update={"mesh": m}) for m in allowed]
        found = [p for p in found if p.key() not in done and free(p)]
        for sibling in found:
            one(sibling)
        if found:
            best = min((done[p.key()] for p in found), key=order_key)
            say(f"projection ({label}): {len(found)} other data x fsdp splits re-costed from that trace; the best, "
                f"{best.plan.describe()}: {_short(best)}")

    def projected(plan: SlicePlan) -> ProjectedPlan:
        result = one(plan)
        say(f"projection ({label}): {plan.describe()}: {_short(result)}")
        siblings(plan)
        keep(ranking([]))
        return result

    if per_chip == start.per_chip_batch:  # the script's batch is that per chip: the before plan's projection
        done[start.key()] = before.model_copy(update={"plan": start})
        siblings(start)
    elif (error := projected(start).error) and "batch cannot be changed" in error:
        notes.append(f"the script's batch cannot be changed, so per-chip batches were not searched: {error}")
        start = before.plan
        done.clear()
        done[start.key()] = before
    expanded: set[tuple] = set()
    stopped = False
    while not stopped:
        current = _next_to_expand(list(done.values()), expanded)
        if current is None:
            break  # the best plan, and every plan faster than it that does not fit, expanded
        expanded.add(current.key())
        for plan in neighbours(current, allowed, blocks):
            if plan.key() in done:
                continue
            if _traces(project, count) >= budget and not (free is not None and free(plan)):
                notes.append(f"the search stopped at its budget of {budget} traces, plans next to "
                             f"{current.describe()} left unprojected")
                stopped = True
                break
            projected(plan)
    if not blocks:
        notes.append("no repeated blocks found: checkpointing not searched")
    if tensor_dims is None:
        notes.append("the model's Linear widths are unknown: no tensor axis searched")
    best = best_fitting(list(done.values()))
    dropped = [p for p in done.values() if p.error is None and not p.fits and p.step_s is not None
               and (best is None or _cost(p) < _cost(best))]
    for p in dropped:
        notes.append(f"{p.plan.describe()} was projected faster but left out for memory: {fit_text(p)} of "
                     f"{size_text(p.hbm_bytes)} HBM per chip (the projection's memory model: parameters, optimizer "
                     "state and the activations saved for backward)")
    final = ranking([])
    if final.after is None:
        final.notes.append(f"no plan projected fits in HBM per chip ({label})")
    keep(final)
    return final


def _next_to_expand(done: list[ProjectedPlan], expanded: set[tuple]) -> SlicePlan | None:
    """Best first: the fastest plan that fits, or a faster one that does not (checkpointing or another mesh next
    to it may make it fit); while none fits, the one with the least memory per chip."""
    open_ = [p for p in done if p.plan.key() not in expanded and p.error is None and p.step_s is not None]
    fit = best_fitting(done)
    if fit is None:
        return min(open_, key=lambda p: p.memory_per_chip_bytes or 0.0).plan if open_ else None
    ahead = [p for p in open_ if (p.fits and p is fit) or (not p.fits and _cost(p) < _cost(fit))]
    return min(ahead, key=_cost).plan if ahead else None


def size_text(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def mfu_text(mfu: float | None) -> str:
    return "-" if mfu is None else f"{mfu * 100:.3g}%"


def _short(p: ProjectedPlan) -> str:
    if p.error is not None:
        return f"failed: {p.error}"
    per = f", {p.time_per_sample_s * 1e3:.4g} ms per sample" if p.time_per_sample_s is not None else ""
    return (f"step {p.step_s * 1e3:.4g} ms{per}, MFU {mfu_text(p.mfu)}, {size_text(p.memory_per_chip_bytes)} per "
            f"chip ({fit_text(p)})")


def fit_text(p: ProjectedPlan) -> str:
    """'fits, 12 GiB free' or 'does not fit: 3.1 GiB over' (the margin on the projection's memory model)."""
    margin = p.margin_bytes
    if margin is None:
        return "fits" if p.fits else "does not fit"
    return f"fits, {size_text(margin)} free" if p.fits else f"does not fit: {size_text(-margin)} over"


def tensor_dims(modules) -> list[int] | None:
    """The widths a tensor-parallel split cuts: in and out features of the Linear layers built more than once (the
    repeated blocks'; a profile's `modules`). None when the profile read none."""
    if modules is None:
        return None
    dims = [v for m in modules.sizes if m.kind == "Linear" and m.count > 1
            for k, v in m.sizes.items() if k in ("in_features", "out_features") and isinstance(v, int)]
    return dims or None
