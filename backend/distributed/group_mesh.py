"""Which mesh over a job's ranks holds several process groups, each as the line along one of its axes.

A fused graph whose collectives run over several groups (a 2-D DeviceMesh's dp and tp groups) can run as ONE
program over every rank of the job when each group is a line of one mesh over the ranks 0..world-1, laid out
row-major as DeviceMesh lays them: each group is then the ranks along one axis through this rank (or along
several neighbouring axes: the world group beside a 2-D mesh's), and its collectives are `psum` / `all_gather` /
`psum_scatter` over that axis, every rank's program holding every group's collectives (in_program.py). Every rank of a DeviceMesh finds the same mesh from its own groups (same strides and
sizes); the ranks' check before each run compares the collectives with their replica groups, so ranks that found
different ones run op by op. Groups that are no such lines (`new_group([0, 3])` beside `[0, 1]`) have no mesh:
the reason is returned, one line. No torch, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupMesh:
    """A row-major mesh over ranks 0..world-1 (`shape`, its axes `names`, outermost first) and the axis of each
    group: one name, or a tuple of neighbouring axes (outermost first) for a group spanning several, as the
    world group does beside a 2-D mesh's."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    axes: dict  # group (its global ranks, ascending) -> axis name, or a tuple of them

    @property
    def world(self) -> int:
        size = 1
        for n in self.shape:
            size *= n
        return size


def mesh_for(groups, me: int, world: int) -> GroupMesh | str:
    """The mesh over ranks 0..world-1 in which each of `groups` (tuples of global ranks, each holding `me`) is
    the block along one or more neighbouring axes through `me`; or why there is none.

    A group of evenly spaced ranks (stride s, n of them) spans the rank spacings s up to s * n; the mesh's axes
    are cut at every group's two ends, and it exists when each cut divides the next."""
    spans: dict[tuple[int, ...], tuple[int, int]] = {}  # group -> (stride, size)
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
        stride, size = steps.pop(), len(group)
        if group != tuple(me - (me // stride) % size * stride + j * stride for j in range(size)):
            return f"group {list(group)} is not a line of a mesh over the {world} ranks"
        spans[group] = (stride, size)
    cuts = sorted({1, world}.union(*({s, s * n} for s, n in spans.values())))
    if any(b % a for a, b in zip(cuts, cuts[1:])) or cuts[-1] != world:
        return f"the groups' rank spacings {', '.join(map(str, cuts))} do not nest: each must divide the next"
    inner = cuts[:-1]  # each axis's stride, innermost first
    names = [f"mesh{i}" for i in range(len(inner) + (single is not None))]
    shape = [b // a for a, b in zip(cuts, cuts[1:])][::-1]
    axis_of = {stride: names[len(inner) - 1 - i] for i, stride in enumerate(inner)}
    axes: dict = {}
    for group, (stride, size) in spans.items():
        spanned = tuple(axis_of[c] for c in reversed(inner) if stride <= c < stride * size)
        axes[group] = spanned[0] if len(spanned) == 1 else spanned
    if single is not None:  # a group of this rank alone: an axis of one
        shape.append(1)
        axes[single] = names[-1]
    return GroupMesh(tuple(shape), tuple(names), axes)
