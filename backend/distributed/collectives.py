"""Collectives as XLA programs over the ranks' devices: no torch, no copy to the host.

Each rank passes its local `jax.Array`; it is, as it is, its block of a global array laid along dim 0 over a
one-axis mesh of the group's devices (`jax.make_array_from_single_device_arrays`), a jitted `shard_map` runs
the collective (`psum`, `all_gather`, `psum_scatter`, `all_to_all`...), and the rank reads back its own
block: one program, no copy in or out (a leading axis of 1 added and taken off had cost two more programs per
collective, benchmarks/collectives.py). A 0-d array travels as shape (1,). Every rank of
the group must call the same collective in the same order, as with NCCL or gloo. One program per
(collective, group, reduce op), compiled once per shape and dtype.

While the profiler records (`record(True)`, `tpu-agent profile`), each collective is timed on its rank: its
input waited for first, then from issue to its result's completion (`block_until_ready`), so the time is the
collective's own, waiting for the other ranks to join included; with its bytes, by (op, group) in `RECORDED`.
What this keeps between calls (meshes, programs, the count of programs run, the record) lives in
STATE.distributed.collectives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.state import STATE
from . import faults
from .runtime import devices_of

AXIS = "ranks"
REDUCE_OPS = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")


@dataclass
class Totals:
    """One (op, group)'s collectives on this rank since recording began: measured."""

    calls: int = 0
    bytes: int = 0  # as nccl-tests counts a collective's size: the gathered output of an all_gather, else the input
    seconds: float = 0.0  # issue to completion, the input waited for first


RECORDED = STATE.distributed.collectives.recording  # the same object (the profiler reads it): (op, ranks) -> Totals


def record(on: bool) -> None:
    """Time every collective from here (the profiler's switch; off, a collective adds no wait of its own)."""
    RECORDED.on = on


def mesh_of(ranks: tuple[int, ...]) -> Mesh:
    meshes = STATE.distributed.collectives.meshes
    mesh = meshes.get(ranks)
    if mesh is None:
        mesh = meshes[ranks] = Mesh(np.array(devices_of(ranks)), (AXIS,))
    return mesh


def _program(kind: str, ranks: tuple[int, ...], fn, **static):
    key = (kind, ranks, tuple(sorted(static.items())))
    programs = STATE.distributed.collectives.programs
    program = programs.get(key)
    if program is None:
        mesh = mesh_of(ranks)
        body = partial(fn, n=len(ranks), **static)
        program = programs[key] = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    return program


def _run(kind: str, ranks: tuple[int, ...], local, fn, *, size: int | None = None, **static):
    """`fn` on the group's blocks (each rank's array, dim 0 the ranks' blocks laid end to end); this rank's
    result block. `size`: the bytes recorded for it (default: the input's)."""
    mesh = mesh_of(ranks)
    device = mesh.devices.flat[_position(mesh)]
    local = jax.device_put(local, device)
    scalar = local.ndim == 0
    block = local.reshape(1) if scalar else local
    global_array = jax.make_array_from_single_device_arrays((len(ranks) * block.shape[0], *block.shape[1:]),
                                                            NamedSharding(mesh, P(AXIS)), [block])
    timed = RECORDED.on and not isinstance(local, jax.core.Tracer)
    if timed:
        local.block_until_ready()  # the input's own computation is not the collective's time
        start = time.perf_counter()
    elif RECORDED.on:
        RECORDED.untimed += 1
    STATE.distributed.collectives.runs += 1  # collective programs run between other programs, counted
    with faults.watching(kind, ranks):  # a collective some rank never joins times out, naming it
        out = _program(kind, ranks, fn, **static)(global_array)
        if timed:
            out.block_until_ready()
    if timed:
        totals = RECORDED.totals.setdefault((kind, ranks), Totals())
        totals.calls += 1
        totals.bytes += local.size * local.dtype.itemsize if size is None else size
        totals.seconds += time.perf_counter() - start
    mine = out.addressable_data(0)
    return mine.reshape(()) if scalar and mine.shape == (1,) else mine


def _position(mesh: Mesh) -> int:
    pid = jax.process_index()
    for i, d in enumerate(mesh.devices.flat):
        if d.process_index == pid:
            return i
    raise RuntimeError("tpu: this rank is not in the group it ran a collective on")


def my_rank() -> int:
    """This process's global rank (its JAX process index: runtime.py joins with process_id = RANK)."""
    return jax.process_index()


def _reduce(x, op: str, n: int, axis: str = AXIS):
    """Reduce a block over the ranks (the mesh axis `axis`)."""
    if op == "sum":
        return jax.lax.psum(x, axis) if x.dtype != jnp.bool_ else jax.lax.pmax(x, axis)
    if op == "avg":
        total = jax.lax.psum(x, axis)
        return (total / n).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else total // n
    if op == "max":
        return jax.lax.pmax(x, axis)
    if op == "min":
        return jax.lax.pmin(x, axis)
    gathered = jax.lax.all_gather(x, axis)  # (n, ...): the ops XLA has no collective for
    if op == "product":
        out = jnp.prod(gathered, axis=0, dtype=x.dtype)
    else:
        fn = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
        out = gathered[0]
        for i in range(1, n):
            out = fn(out, gathered[i])
    return out


# The collectives' bodies: a rank's block in, its result out, over the mesh axis `axis` (shared with
# in_program.py, which traces them inside a fused graph's SPMD program, there over one axis of a 2-D mesh too).
def all_reduce_body(x, n: int, op: str, axis: str = AXIS):
    return _reduce(x, op, n, axis)


def all_gather_body(x, n: int, axis: str = AXIS):
    return jax.lax.all_gather(x, axis, axis=0, tiled=True)


def reduce_scatter_body(x, n: int, op: str, axis: str = AXIS):
    out = jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    if op == "avg":
        out = (out / n).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else out // n
    return out


def broadcast_body(x, n: int, root: int, axis: str = AXIS):
    return jax.lax.all_gather(x, axis)[root]


def all_to_all_body(x, n: int, axis: str = AXIS):
    return jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


def all_reduce(local, ranks: tuple[int, ...], op: str = "sum"):
    if op not in REDUCE_OPS:
        raise NotImplementedError(f"tpu: all_reduce with reduce op {op!r} is not supported ({', '.join(REDUCE_OPS)})")
    return _run("all_reduce", ranks, local, all_reduce_body, op=op)


def all_gather(local, ranks: tuple[int, ...]):
    """The ranks' arrays concatenated along dim 0 (`all_gather_into_tensor`)."""
    return _run("all_gather", ranks, local, all_gather_body, size=local.size * local.dtype.itemsize * len(ranks))


def reduce_scatter(local, ranks: tuple[int, ...], op: str = "sum"):
    """Reduce over the ranks, then this rank's 1/n slice of dim 0 (`reduce_scatter_tensor`)."""
    if op not in ("sum", "avg"):
        reduced = all_reduce(local, ranks, op)
        n, i = len(ranks), _position(mesh_of(ranks))
        size = local.shape[0] // n
        return reduced[i * size:(i + 1) * size]

    return _run("reduce_scatter", ranks, local, reduce_scatter_body, op=op)


def broadcast(local, ranks: tuple[int, ...], root: int):
    """The root's array on every rank (`root`: its position in `ranks`). Exact: selected, not summed."""
    return _run("broadcast", ranks, local, broadcast_body, root=root)


def all_to_all(local, ranks: tuple[int, ...]):
    """Dim 0 split into n equal chunks, chunk j sent to rank j, received chunks concatenated in rank order."""
    return _run("all_to_all", ranks, local, all_to_all_body)


def barrier(ranks: tuple[int, ...]) -> None:
    """An all-reduce of one int32 (4 bytes), recorded as a barrier."""
    _run("barrier", ranks, jnp.zeros((), jnp.int32), lambda x, n, op: _reduce(x, op, n), op="sum").block_until_ready()
