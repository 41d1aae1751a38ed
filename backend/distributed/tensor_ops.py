"""The process group's collectives on tpu tensors: their arrays in, results written back in place.

A pending fused graph runs first (a collective is a sync point of fused mode, as on TorchTPU); the values
then go to collectives.py as `jax.Array`s and come back as arrays on the same device: nothing is copied to
the host.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import lazy
from ..lazy import RECORDER
from ..tensor import TpuTensor
from . import collectives

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


def _write(t: TpuTensor, value) -> None:
    if value.dtype != jnp.dtype(array(t).dtype):
        value = value.astype(array(t).dtype)
    t.set_jax(value.reshape(tuple(t.shape)))


def all_reduce_(t, ranks, op: str, only_rank: int | None = None) -> None:
    """All-reduce into `t` (with `only_rank`, a group rank, a reduce: the result is written there alone)."""
    value = collectives.all_reduce(array(t), ranks, op)
    if only_rank is None or ranks.index(collectives.my_rank()) == only_rank:
        _write(t, value)


def broadcast_(t, ranks, root: int) -> None:
    """`root`: the source's rank in the group (its position in `ranks`)."""
    _write(t, collectives.broadcast(array(t), ranks, root))


def all_gather_into(output, t, ranks) -> None:
    _write(output, collectives.all_gather(array(t), ranks))


def all_gather_list(outputs, t, ranks) -> None:
    gathered = collectives.all_gather(array(t)[None], ranks)  # (n, *shape)
    for i, out in enumerate(outputs):
        _write(out, gathered[i])


def reduce_scatter_into(output, t, ranks, op: str) -> None:
    _write(output, collectives.reduce_scatter(array(t), ranks, op))


def reduce_scatter_list(output, inputs, ranks, op: str) -> None:
    stacked = jnp.stack([array(t) for t in inputs])  # (n, *shape): rank i keeps the sum of everyone's inputs[i]
    _write(output, collectives.reduce_scatter(stacked, ranks, op))


def all_to_all_into(output, t, ranks, output_splits: list[int], input_splits: list[int]) -> None:
    n = len(ranks)
    value = array(t)
    equal = value.shape[0] // n if value.shape[0] % n == 0 else None
    if any(s != equal for s in output_splits + input_splits):
        raise NotImplementedError("tpu: all_to_all_single with unequal split sizes is not supported "
                                  f"(input splits {input_splits}, output splits {output_splits})")
    _write(output, collectives.all_to_all(value, ranks))


def all_to_all_list(outputs, inputs, ranks) -> None:
    values = [array(t) for t in inputs]
    if len({(v.shape, v.dtype) for v in values}) != 1:
        raise NotImplementedError("tpu: all_to_all with tensors of different shapes is not supported")
    received = collectives.all_to_all(jnp.stack(values), ranks)  # (n, *shape): row j came from rank j
    for j, out in enumerate(outputs):
        _write(out, received[j])


def gather_list(outputs, t, ranks, write: bool) -> None:
    gathered = collectives.all_gather(array(t)[None], ranks)
    if write:
        for i, out in enumerate(outputs):
            _write(out, gathered[i])


def scatter_from(output, inputs, ranks, root: int) -> None:
    """Rank i gets the root's inputs[i] (`root`: a group rank; the others pass zeros in place of inputs)."""
    me = ranks.index(collectives.my_rank())
    value = jnp.stack([array(t) for t in inputs]) if me == root else jnp.zeros((len(ranks), *output.shape), array(output).dtype)
    _write(output, collectives.broadcast(value, ranks, root)[me])


def barrier(ranks) -> None:
    RECORDER.flush(REASON)
    collectives.barrier(ranks)
