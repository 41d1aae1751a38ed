"""Which mesh over a job's ranks holds several process groups, each as the line along one of its axes.

A fused graph whose collectives run over several groups (a 2-D DeviceMesh's dp and tp groups) can run as ONE
program over every rank of the job when each group is a line of one mesh over the ranks 0..world-1, laid out
row-major as DeviceMesh lays them: each group is then the ranks along one axis through this rank, and its
collectives are `psum` / `all_gather` / `psum_scatter` over that axis, every rank's program holding every group's
collectives (in_program.py). Every rank of a DeviceMesh finds the same mesh from its own groups (same strides and
sizes); the ranks' check before each run compares the collectives with their replica groups, so ranks that found
different ones run op by op. Groups that are no such lines (`new_group([0, 3])` beside `[0, 1]`) have no mesh:
the reason is returned, one line. No torch, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupMesh:
    """A row-major mesh over ranks 0..world-1 (`shape`, its axes `names`, outermost first) and the axis of each
    group."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    axes: dict  # group (its global ranks, ascending) -> axis name

    @property
    def world(self) -> int:
        size = 1
        for n in self.shape:
            size *= n
        return size


def mesh_for(groups, me: int, world: int) -> GroupMesh | str:
    """The mesh over ranks 0..world-1 in which each of `groups` (tuples of global ranks, each holding `me`) is
    the line along one axis through `me`; or why there is none."""
    lines: dict[int, tuple[int, tuple[int, ...]]] = {}  # stride -> (size, group)
    single = None
    for group in dict.fromkeys(tuple(g) for g in groups):
        if me not in group:
            return f"rank {me} is not in group {list(group)}"
        if list(group) != sorted(set(group)) or group[0] < 0 or group[-1] >= world:
            return f"group {list(group)} is not ascending ranks of the {world}"
        if len(group) == 1:
            single = group
            continue
        steps = {b - a for a, b in zip(group, group[1:])}
        if len(steps) != 1:
            return f"group {list(group)} is not evenly spaced"
        stride = steps.pop()
        if stride in lines:
            return f"groups {list(lines[stride][1])} and {list(group)} lie along the same ranks' spacing"
        lines[stride] = (len(group), group)
    dims: list[tuple[int, tuple[int, ...] | None]] = []  # innermost first: (size, its group or None)
    covered = 1  # the ranks one step of the next axis out spans
    for stride in sorted(lines):
        size, group = lines[stride]
        if stride % covered:
            return f"group {list(group)} cuts across group {list(dims[-1][1])}'s axis"
        if stride > covered:
            dims.append((stride // covered, None))
        dims.append((size, group))
        covered = stride * size
        if group != tuple(me - (me // stride) % size * stride + j * stride for j in range(size)):
            return f"group {list(group)} is not a line of a mesh over the {world} ranks"
    if world % covered:
        return f"the groups' {covered} ranks do not tile the {world}"
    if world > covered:
        dims.append((world // covered, None))
    if single is not None:
        dims.append((1, single))
    dims.reverse()
    names = tuple(f"mesh{i}" for i in range(len(dims)))
    return GroupMesh(tuple(n for n, _ in dims), names, {g: name for (_, g), name in zip(dims, names) if g})
