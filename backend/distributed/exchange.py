"""The exchanges XLA has no collective of their own for, built from the equal ones in collectives.py: all_to_all
with unequal split sizes (MoE expert parallelism's token dispatch), all_to_all over tensors of different
sizes, and send/recv.

Unequal splits: XLA's all_to_all sends every rank a block of one static size, so each rank pads its chunks to
the largest chunk any rank sends (one max all-reduce of a scalar, rounded up to a power of two so a run whose
splits change each step compiles a few programs, not one per step), exchanges the padded blocks, and keeps
the first `output_splits[j]` rows of the block from rank j. Padding and unpadding are one gather each; the
data never leaves the device. send/recv is a broadcast over the two ranks, from the sender.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..core.jax_setup import device_x64
from . import collectives
from .tensor_ops import array


def _write(t, value) -> None:
    t.set_jax(value.astype(array(t).dtype).reshape(tuple(t.shape)))


def _padded_size(largest: int) -> int:
    return 0 if largest <= 0 else 1 << (largest - 1).bit_length()


def all_to_all_uneven(x, ranks: tuple[int, ...], output_splits: list[int], input_splits: list[int]):
    """Rows `input_splits[j]` of `x` (dim 0, in order) to rank j; the rows from each rank, concatenated in
    rank order (`output_splits[j]` from rank j)."""
    n = len(ranks)
    if len(input_splits) != n or len(output_splits) != n or sum(input_splits) != x.shape[0]:
        raise ValueError(f"tpu: all_to_all_single: split sizes {input_splits} (input) and {output_splits} "
                         f"(output) must each have {n} entries, the input's summing to its {x.shape[0]} rows")
    largest = collectives.all_reduce(jnp.asarray(max(input_splits), jnp.int32), ranks, "max")
    block = _padded_size(int(largest))
    rest = x.shape[1:]
    if block == 0:  # nothing sent anywhere (every rank found the same)
        return jnp.zeros((sum(output_splits), *rest), x.dtype)
    # padded[j * block + k] = x[offset_j + k] for k < input_splits[j], else a zero row (index len(x))
    take = np.full((n, block), x.shape[0], np.int32)
    offsets = np.cumsum([0, *input_splits[:-1]])
    for j, (start, size) in enumerate(zip(offsets, input_splits)):
        take[j, :size] = np.arange(start, start + size)
    with_zero = jnp.concatenate([x, jnp.zeros((1, *rest), x.dtype)])
    received = collectives.all_to_all(jnp.take(with_zero, jnp.asarray(take.reshape(-1)), axis=0), ranks)
    keep = np.concatenate([j * block + np.arange(size) for j, size in enumerate(output_splits)]).astype(np.int32)
    return jnp.take(received, jnp.asarray(keep), axis=0)


@device_x64()
def all_to_all_single(output, t, ranks, output_splits: list[int], input_splits: list[int]) -> None:
    _write(output, all_to_all_uneven(array(t), ranks, output_splits, input_splits))


@device_x64()
def all_to_all_list(outputs, inputs, ranks) -> None:
    """inputs[j] to rank j, outputs[j] from rank j, of any sizes (one dtype): flattened, an uneven exchange."""
    values = [array(t) for t in inputs]
    dtypes = {v.dtype for v in values} | {array(t).dtype for t in outputs}
    if len(dtypes) != 1:
        raise NotImplementedError(f"tpu: all_to_all over tensors of different dtypes ({sorted(map(str, dtypes))}) "
                                  "is not supported")
    flat = jnp.concatenate([v.reshape(-1) for v in values])
    sizes = [t.numel() for t in outputs]
    received = all_to_all_uneven(flat, ranks, sizes, [int(v.size) for v in values])
    for out, start, size in zip(outputs, np.cumsum([0, *sizes[:-1]]), sizes):
        _write(out, received[start:start + size])


@device_x64()
def send(t, me: int, peer: int) -> None:
    """`t` to global rank `peer` (the receiver's recv must come next in its own order)."""
    pair = tuple(sorted((me, peer)))
    collectives.broadcast(array(t), pair, pair.index(me)).block_until_ready()


@device_x64()
def recv(t, me: int, peer: int) -> None:
    """Global rank `peer`'s sent tensor into `t` (same shape and dtype)."""
    pair = tuple(sorted((me, peer)))
    _write(t, collectives.broadcast(array(t), pair, pair.index(peer)))
