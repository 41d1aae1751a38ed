"""The process group's collectives on tpu tensors: their arrays in, results written back in place.

In fused mode the collectives DDP and FSDP2 use (all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor, all_to_all_single) are recorded into the pending graph, which then runs as one program
over the ranks (in_program.py). Otherwise, and for the rest, a pending fused graph runs first (a sync point,
as on TorchTPU); the values then go to collectives.py as `jax.Array`s and come back as arrays on the same
device: nothing is copied to the host. Each function here is an entry from the process group (not an op):
each runs in the device's 64-bit scope.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..core import dtypes, lazy
from ..core.jax_setup import device_x64
from ..core.lazy import RECORDER
from ..core.tensor import TpuTensor
from . import collectives, in_program

REASON = "collective"  # the flush reason: a sync point, not a graph break


def array(t) -> object:
    """A tpu tensor's concrete array (pending fused work run first)."""
    if not isinstance(t, TpuTensor):
        raise RuntimeError(f"tpu process group: expected a tpu tensor, got one on {t.device}")
    value = t.jax()
    if type(value) is lazy.Lazy:
        RECORDER.flush(REASON, also=[value], op="a collective")
        value = value.value if value.value is not None else t.jax()
        if type(value) is lazy.Lazy:
            RECORDER.flush(REASON, also=[value], op="a collective")
            value = value.value
    return value


def _recorded(kind: str, output, t, ranks, **static) -> bool:
    """In fused mode: `kind` recorded into the pending graph, its result written to `output`; else False."""
    if not in_program.recording():
        return False
    if not isinstance(t, TpuTensor):
        array(t)  # the one error for a tensor on another device
    output.set_jax(in_program.record(kind, ranks, t.jax(), tuple(output.shape), dtypes.to_jax_dtype(output.dtype),
                                     **static))
    return True


def _write(t: TpuTensor, value) -> None:
    if value.dtype != jnp.dtype(array(t).dtype):
        value = value.astype(array(t).dtype)
    t.set_jax(value.reshape(tuple(t.shape)))


@device_x64()
def all_reduce_(t, ranks, op: str, only_rank: int | None = None) -> None:
    """All-reduce into `t` (with `only_rank`, a group rank, a reduce: the result is written there alone)."""
    if only_rank is None and _recorded("all_reduce", t, t, ranks, op=op):
        return
    value = collectives.all_reduce(array(t), ranks, op)
    if only_rank is None or ranks.index(collectives.my_rank()) == only_rank:
        _write(t, value)


@device_x64()
def broadcast_(t, ranks, root: int) -> None:
    """`root`: the source's rank in the group (its position in `ranks`)."""
    if _recorded("broadcast", t, t, ranks, root=root):
        return
    _write(t, collectives.broadcast(array(t), ranks, root))


@device_x64()
def all_gather_into(output, t, ranks) -> None:
    if t.dim() and _recorded("all_gather", output, t, ranks):
        return
    _write(output, collectives.all_gather(array(t), ranks))


@device_x64()
def all_gather_list(outputs, t, ranks) -> None:
    gathered = collectives.all_gather(array(t)[None], ranks)  # (n, *shape)
    for i, out in enumerate(outputs):
        _write(out, gathered[i])


@device_x64()
def reduce_scatter_into(output, t, ranks, op: str) -> None:
    recordable = op in ("sum", "avg") and t.dim() and t.shape[0] % len(ranks) == 0
    if recordable and _recorded("reduce_scatter", output, t, ranks, op=op):
        return
    _write(output, collectives.reduce_scatter(array(t), ranks, op))


@device_x64()
def reduce_scatter_list(output, inputs, ranks, op: str) -> None:
    stacked = jnp.stack([array(t) for t in inputs])  # (n, *shape): rank i keeps the sum of everyone's inputs[i]
    _write(output, collectives.reduce_scatter(stacked, ranks, op))


@device_x64()
def all_to_all_into(output, t, ranks, output_splits: list[int], input_splits: list[int]) -> None:
    n = len(ranks)
    rows = t.shape[0] if t.dim() else 0
    if (t.dim() and rows % n == 0 and all(s == rows // n for s in output_splits + input_splits)
            and _recorded("all_to_all", output, t, ranks)):
        return
    value = array(t)
    equal = value.shape[0] // n if value.shape[0] % n == 0 else None
    if any(s != equal for s in output_splits + input_splits):
        raise NotImplementedError("tpu: all_to_all_single with unequal split sizes is not supported "
                                  f"(input splits {input_splits}, output splits {output_splits})")
    _write(output, collectives.all_to_all(value, ranks))


@device_x64()
def all_to_all_list(outputs, inputs, ranks) -> None:
    values = [array(t) for t in inputs]
    if len({(v.shape, v.dtype) for v in values}) != 1:
        raise NotImplementedError("tpu: all_to_all with tensors of different shapes is not supported")
    received = collectives.all_to_all(jnp.stack(values), ranks)  # (n, *shape): row j came from rank j
    for j, out in enumerate(outputs):
        _write(out, received[j])


@device_x64()
def gather_list(outputs, t, ranks, write: bool) -> None:
    gathered = collectives.all_gather(array(t)[None], ranks)
    if write:
        for i, out in enumerate(outputs):
            _write(out, gathered[i])


@device_x64()
def scatter_from(output, inputs, ranks, root: int) -> None:
    """Rank i gets the root's inputs[i] (`root`: a group rank; the others pass zeros in place of inputs)."""
    me = ranks.index(collectives.my_rank())
    value = jnp.stack([array(t) for t in inputs]) if me == root else jnp.zeros((len(ranks), *output.shape), array(output).dtype)
    _write(output, collectives.broadcast(value, ranks, root)[me])


@device_x64()
def barrier(ranks) -> None:
    RECORDER.flush(REASON)
    collectives.barrier(ranks)
