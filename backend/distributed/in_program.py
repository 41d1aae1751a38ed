"""Collectives inside fused mode's graph: the graph then runs as ONE SPMD program over the ranks.

Without this a collective is a sync point of fused mode: the pending graph runs, the collective runs as its own
program (collectives.py), and a new graph starts, so a DDP step is a program per gradient bucket and the pieces
between them. With it (fused mode, `TPU_AGENT_COLLECTIVES_IN_PROGRAM` not `0`) a collective on tpu tensors is a
node of the graph, and the flushed graph runs under `shard_map` over a one-axis mesh of the collective's ranks:
every input and output replicated in the sharding's words (`P()`, unchecked), which means each rank's own
array, as it is, with no copy; the collectives as `psum` / `all_gather` / `psum_scatter` / `all_to_all` over
the axis. A graph with collectives over several groups (a 2-D DeviceMesh's dp and tp groups) runs over every
rank of the job, on a mesh (group_mesh.py) in which each group is the line along one axis (or the block along
neighbouring axes: the world beside tp), its collectives over that axis: one program per step for FSDP x TP on a 2 x 2 mesh. Where the groups are no lines of one mesh
(arbitrary `new_group` splits) a collective over another group ends the graph first, and the rank says why once.

What must hold: every rank of the group runs its collectives in the same order with the same shapes. Before each
run the ranks compare a fingerprint of their compiled programs' collectives, in the order XLA scheduled them, with
one small all-gather between programs. Programs may differ elsewhere: FSDP2 copies each rank's shard into its own
slot of the all-gather buffer, a slice at the rank's offset. Two programs differing only in a constant (a tensor
plus 10 * rank) were scheduled with their collectives in different orders and hung (XLA's quick-compile flags,
2026-12-05); the order is what is compared. Checking only a program's first run hung too: rank 0 read its loss
mid-step (a new program, checked) while rank 1 ran the step's program it had agreed on before (unchecked), and the
check's all-gather met the program's collectives. Where they differ, every rank runs its graph op by op instead,
its collectives between programs as without this (correct wherever the ranks' collectives come in the same
order, as they must on any backend), and says so once. Every run is also watched as a collective is (faults.py):
a rank that never joins ends the job with one line naming the graph. Every recorded collective is an output of its
graph, so no rank's graph drops one whose result it does not read. A torch.compile(step) capture records them
too: the captured program is this one, replayed with the same check each call. What this keeps between calls (the
programs, the pending graph's collectives) lives in STATE.distributed.in_program.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_agent import envvars

from ..core import lazy
from ..core.lazy import RECORDER
from ..core.state import STATE
from . import collectives, faults
from .group_mesh import GroupMesh, mesh_for
from .runtime import devices_of

SWITCH = envvars.COLLECTIVES_IN_PROGRAM
GROUP_CHANGE = "collective over another group"  # the flush reason when a graph's collectives change group


def enabled() -> bool:
    return SWITCH.value != "0"


def recording() -> bool:
    """Whether a collective met now is recorded into the pending graph: fused mode (a compile capture records in
    it too), not while the profiler times each collective (collectives.record: `tpu-agent profile` reports every
    collective's bytes and time, which a collective inside a program does not have)."""
    return STATE.fused and not collectives.RECORDED.on and enabled()


_BODIES = MappingProxyType({
    "all_reduce": collectives.all_reduce_body,
    "all_gather": collectives.all_gather_body,
    "reduce_scatter": collectives.reduce_scatter_body,
    "broadcast": collectives.broadcast_body,
    "all_to_all": collectives.all_to_all_body,
})
_BETWEEN = MappingProxyType({  # the same collective as its own program, for a graph run op by op
    "all_reduce": collectives.all_reduce, "all_gather": collectives.all_gather,
    "reduce_scatter": collectives.reduce_scatter, "broadcast": collectives.broadcast,
    "all_to_all": collectives.all_to_all,
})


@dataclass(eq=False)
class CollectiveProgram(lazy.Program):
    """A collective as a node of the graph: its body over the ranks' axis, then the shape and dtype its output
    tensor has (all_gather_into_tensor's output may be laid out otherwise than the gathered blocks)."""

    def abstract_eval(self, args):
        key = tuple(lazy._aval_key(a) for a in args)
        cached = self.out_avals.get(key)
        if cached is None:
            over = jax.shard_map(self.raw, mesh=collectives.mesh_of(self.ranks), in_specs=P(), out_specs=P(),
                                 check_vma=False)  # the axis is bound only inside the mesh's program
            shaped = jax.eval_shape(over, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
            cached = self.out_avals[key] = (jax.tree_util.tree_structure(shaped), [shaped])
        return cached

    def over_ranks(self, graph, programs, args) -> "SpmdGraph":
        groups = list(dict.fromkeys(p.ranks for p in programs if p.ranks is not None))
        names = [p.name for p in programs if p.ranks is not None]
        held = ", ".join(f"{k} x{names.count(k)}" for k in dict.fromkeys(names))
        if len(groups) == 1:
            return SpmdGraph(graph, self.ranks, held)
        layout = mesh_for(groups, collectives.my_rank(), jax.process_count())
        if isinstance(layout, str):  # record() ends a graph before a group with no common mesh
            raise RuntimeError(f"tpu: a fused graph with collectives over groups {groups}: {layout}")
        return SpmdGraph(graph, tuple(range(layout.world)), held, layout)


def _program(kind: str, ranks: tuple[int, ...], shape, dtype, static: dict) -> CollectiveProgram:
    key = (kind, ranks, shape, str(dtype), tuple(sorted(static.items())))
    state = STATE.distributed.in_program
    program = state.programs.get(key)
    if program is None:
        body, between, n = _BODIES[kind], _BETWEEN[kind], len(ranks)

        def raw(x):
            # Traced inside the graph's SPMD program (over the group's axis of its mesh); called on an array when
            # the graph runs op by op.
            if isinstance(x, jax.core.Tracer):
                out = body(x, n, axis=STATE.distributed.in_program.axes.get(ranks, collectives.AXIS), **static)
            else:
                out = between(x, ranks, **static)
            out = out if shape is None else out.reshape(shape)
            return out if dtype is None or out.dtype == dtype else out.astype(dtype)

        name = f"c10d.{kind}" + "".join(f"({v})" for _, v in sorted(static.items()))
        # ids count down from -1, below the executables' (which count up from 0)
        program = state.programs[key] = CollectiveProgram(next(state.ids), name, raw, {}, scope=name, ranks=ranks)
    return program


class _Kept:
    """Holds a recorded collective's output as a pending storage does, so that the flush computes it."""

    __slots__ = ("array", "__weakref__")

    def __init__(self, array) -> None:
        self.array = array

    def write(self, array) -> None:
        """A captured step's replay writes each output back to the storage it came from: here, nobody's."""


def _flushed(exe, reason) -> None:
    state = STATE.distributed.in_program
    state.kept.clear()  # this graph's collectives' outputs, until it runs
    state.groups.clear()  # the groups (their global ranks) of this graph's collectives


RECORDER.listeners.append(_flushed)


def record(kind: str, ranks: tuple[int, ...], value, shape=None, dtype=None, **static):
    """Record `kind` over `ranks` on `value` (an array or a pending one) into the graph; its pending result,
    reshaped to `shape` and cast to `dtype` where given."""
    state = STATE.distributed.in_program
    if state.groups and ranks not in state.groups and not _one_mesh(state.groups + [ranks]):
        RECORDER.flush(GROUP_CHANGE, also=[value], op=f"c10d.{kind}")
        state.kept.clear()
        state.groups.clear()
        if type(value) is lazy.Lazy and value.value is not None:
            value = value.value
    if ranks not in state.groups:
        state.groups.append(ranks)
    dtype = None if dtype is None else jnp.dtype(dtype)
    out = RECORDER.record(_program(kind, ranks, None if shape is None else tuple(shape), dtype, static), [value])
    kept = _Kept(out)
    RECORDER.track(kept)
    state.kept.append(kept)
    return out


def _one_mesh(groups) -> bool:
    """Whether one program over the job's ranks can hold collectives over all of `groups`; if not, says why
    (once per reason)."""
    layout = mesh_for(groups, collectives.my_rank(), jax.process_count())
    if isinstance(layout, GroupMesh):
        return True
    said = STATE.distributed.in_program.unmeshed  # the reasons already said
    if layout not in said:
        said.add(layout)
        print(f"tpu: rank {collectives.my_rank()}: a fused graph's collectives over groups "
              f"{', '.join(str(list(g)) for g in groups)} cannot be one program ({layout}): the graph ends at each "
              "change of group", file=sys.stderr, flush=True)
    return False


_COLLECTIVE = re.compile(r"=\s*(.+?)\s+((?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                         r"collective-broadcast)(?:-start|-done)?)\((.*)")


_NAME = re.compile(r"%[\w.-]+")


def collective_order(hlo_text: str) -> str:
    """The collectives of a compiled program in the order XLA runs them (its scheduled text): each one's op, result
    shape, groups and dimensions, without instruction names or source locations."""
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            attributes = re.sub(r",?\s*metadata=\{[^}]*\}", "", match.group(3))
            operands = _NAME.sub("%", attributes)
            found.append(f"{match.group(1)} {match.group(2)}({operands}")
    return "\n".join(found)


def _fingerprint(text: str) -> np.ndarray:
    """Two int32s that tell two ranks' collective orders apart."""
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), np.int32).copy()


class SpmdGraph:
    """A fused graph holding collectives, called as `jax.jit(graph)` would be, on this rank's arrays: it runs
    as one program over the ranks' devices, or op by op where the ranks' graphs differ."""

    def __init__(self, graph, ranks: tuple[int, ...], held: str, layout: GroupMesh | None = None):
        """`layout`: for collectives over several groups, the mesh over `ranks` (all the job's) whose axes they
        are; else the one-axis mesh of `ranks`, the one group."""
        self.graph, self.ranks = graph, ranks
        self.fingerprint = None  # of the compiled program's collectives, known once compiled
        self.compiled = None
        if layout is None:
            mesh, body = collectives.mesh_of(ranks), graph
        else:
            mesh = Mesh(np.array(devices_of(ranks)).reshape(layout.shape), layout.names)

            def body(*args):  # each collective traced over its group's axis (or neighbouring axes, as the world
                axes = STATE.distributed.in_program.axes  # beside tp)
                axes.update(layout.axes)
                try:
                    return graph(*args)
                finally:
                    axes.clear()
        self.device = mesh.devices.flat[collectives._position(mesh)]
        self.sharding = NamedSharding(mesh, P())  # each rank's array as it is (unchecked: they differ)
        self.jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
        self.held = held  # its collectives: "c10d.all_reduce(sum) x2, ..."
        self.label = f"a fused graph with {held}"  # what the watch's timeout line names
        self.said = False

    def lower(self, *args):
        """What Executable.compiled lowers: the arguments as the ranks' global arrays. Compiled once: the
        program this rank runs, and its fingerprint."""
        lowered = self.jitted.lower(*[jax.ShapeDtypeStruct(np.shape(a), _dtype(a), sharding=self.sharding)
                                      for a in args])
        if self.compiled is None:
            self.compiled = lowered.compile()
            self.fingerprint = _fingerprint(collective_order(self.compiled.as_text()))
        return _Lowered(lowered, self.compiled)

    def __call__(self, *args):
        local = [jax.device_put(a, self.device) for a in args]
        if self.fingerprint is None:
            self.lower(*local)
        if not self._ranks_agree():
            return list(self.graph(*local))
        whole = [jax.make_array_from_single_device_arrays(a.shape, self.sharding, [a]) for a in local]
        with faults.watching(self.label, self.ranks):  # a rank that never joins: one line naming the graph
            out = self.compiled(*whole)
        return [o.addressable_data(0) for o in out]

    def _ranks_agree(self) -> bool:
        mine = jax.device_put(self.fingerprint, self.device)
        # an all_gather named for the watch: a rank that never comes times out naming the graph
        everyone = collectives._run(f"the start of {self.label}", self.ranks, mine, collectives.all_gather_body)
        everyone = np.asarray(everyone).reshape(len(self.ranks), -1)
        if (everyone == self.fingerprint).all():
            return True
        if not self.said:
            self.said = True
            me = collectives.my_rank()
            others = [r for r, f in zip(self.ranks, everyone) if (f != self.fingerprint).any()]
            print(f"tpu: rank {me}: its fused graph's collectives differ from rank(s) {others}'s (other "
                  "collectives, shapes or order); it runs op by op, its collectives between programs",
                  file=sys.stderr, flush=True)
        return False


class _Lowered:
    """A lowered program whose compile() is the one already compiled (Executable.compiled asks for it again)."""

    def __init__(self, lowered, compiled):
        self._lowered, self._compiled = lowered, compiled

    def compile(self):
        return self._compiled

    def __getattr__(self, name):
        return getattr(self._lowered, name)


def _dtype(a):
    return a.dtype if hasattr(a, "dtype") else jnp.asarray(a).dtype
