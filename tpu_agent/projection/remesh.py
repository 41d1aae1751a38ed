"""A traced step re-costed for another split of the same chips between the `data` and `fsdp` axes, without a trace.

A slice's plans that differ only in how the batch axes are split (fsdp=256; data=2,fsdp=128; ... data=256) give
each chip the same work: the batch is split over data x fsdp either way, so every op runs on the same per-chip
shapes, and the weights a layer uses are whole on every chip in both (gathered over fsdp, or replicated over data).
What changes is where parameters and optimizer state live and the collectives that move them. So one trace on
the widest fsdp axis stands for every such split (projection/rank.py's search re-costs them for free):

- the parameters and optimizer state split over fsdp (Traced.fsdp_state_bytes) are replicated d times over a data
  axis of size d: d x their bytes per chip, as inputs and as the updated outputs (aliased where the trace was);
- a collective over fsdp alone that gathers weights (all-gather) runs over the smaller fsdp groups (F / d chips);
  so does an all-to-all (a weight shard re-laid for its transpose in backward; with fsdp gone, pure data
  parallelism, none: as `project` on that mesh reads it), its shards d times larger; a reduce-scatter of gradients
  runs over them too, its result d times larger, and the gradients are then all-reduced over data (a ring of d
  chips): the layout MaxText and FSDP2 use for data x fsdp (HSDP);
- any other collective over fsdp (an all-reduce of a loss or a norm) keeps its group, now spanning data and fsdp;
  collectives over a tensor or expert axis are unchanged (that axis keeps its size and its place in the mesh).

Left out: the optimizer's own traffic grows with the state a chip holds (d x a shard of the update's reads and
writes, small beside a training step's), and XLA, given a data x fsdp mesh, may partition the step otherwise: on
the tests' tiny Llama (2 slices of v5e-4), `project` alone on data=4,fsdp=2 got XLA:CPU re-laying the fsdp-split weights
and gathering them over data and fsdp (40 collective-permutes, 37 all-gathers over the slice's 4 chips, 25% more
dot FLOPs: 0.39 ms where the re-costed HSDP layout reads 0.20 ms; on data=8 both read 0.21 ms). The ranking says which plans were re-costed and from which trace (`recosted_from`).
"""

from __future__ import annotations

from .results import Collective, Partitioned, Traced

GATHERS = ("all-gather",)
SCATTERS = ("reduce-scatter",)
RESHARDS = ("all-to-all",)


def data_split(traced_mesh: dict[str, int], mesh: dict[str, int]) -> int | None:
    """d when `mesh` is `traced_mesh` with a data axis of size d carved out of its fsdp axis (and every other axis the
    same), else None. `traced_mesh` has no data axis of its own."""
    if traced_mesh.get("data", 1) != 1:
        return None
    d = mesh.get("data", 1)
    fsdp = traced_mesh.get("fsdp", 1)
    if fsdp % d or mesh.get("fsdp", 1) != fsdp // d:
        return None
    others = {k: v for k, v in mesh.items() if k not in ("data", "fsdp") and v > 1}
    return d if others == {k: v for k, v in traced_mesh.items() if k not in ("data", "fsdp") and v > 1} else None


def _collectives(c: Collective, d: int) -> list[Collective]:
    if "fsdp" not in c.axes:
        return [c]
    alone = c.axes == ["fsdp"]
    if alone and c.kind in GATHERS:
        return [c.model_copy(update={"group_size": c.group_size // d, "groups": c.groups * d, "example_group": []})]
    if alone and c.kind in RESHARDS:  # a weight shard re-laid among its fsdp group: d times larger, over F / d
        return [c.model_copy(update={"group_size": c.group_size // d, "groups": c.groups * d,
                                     "result_bytes": c.result_bytes * d, "example_group": []})]
    if alone and c.kind in SCATTERS:
        shard = c.model_copy(update={"group_size": c.group_size // d, "groups": c.groups * d,
                                     "result_bytes": c.result_bytes * d, "example_group": []})
        across = Collective(kind="all-reduce", result_bytes=c.result_bytes * d, group_size=d,
                            groups=c.groups * c.group_size // d, axes=["data"], name=f"{c.name} (over data)")
        return [shard, across]
    return [c.model_copy(update={"axes": ["data", *c.axes]})]


def _program(p: Traced, d: int) -> Traced:
    extra = (d - 1) * p.fsdp_state_bytes  # the updated state is an output as well, aliased where the trace aliased
    return p.model_copy(update={
        "argument_bytes": int(p.argument_bytes + extra), "output_bytes": int(p.output_bytes + extra),
        "alias_bytes": int(p.alias_bytes + extra if p.alias_bytes else 0), "param_bytes": p.param_bytes + (d - 1) * p.fsdp_param_bytes,
        "fsdp_state_bytes": p.fsdp_state_bytes * d, "fsdp_param_bytes": p.fsdp_param_bytes * d,
        "collectives": [out for c in p.collectives for out in _collectives(c, d)]})


def remesh(partitioned: Partitioned, mesh: dict[str, int]) -> Partitioned:
    """The trace re-costed for `mesh` (one slice's), which must be the traced mesh with data carved out of fsdp."""
    d = data_split(partitioned.mesh, mesh)
    if d is None:
        raise ValueError(f"mesh {mesh} is not the traced mesh {partitioned.mesh} with a data axis carved out of fsdp")
    if d == 1:
        return partitioned
    return partitioned.model_copy(update={"mesh": dict(mesh), "traced_mesh": dict(partitioned.mesh),
                                          "programs": [_program(p, d) for p in partitioned.programs]})
