"""Operand padding (the `PadOps` plan action): matmuls and convolutions run on aligned shapes.

With a multiple set, the matmul lowerings zero-pad M, K and N up to it and
slice the result back; convolutions pad their input and output channels the
same way. Zeros added along a contracted dim contribute nothing to the sums
and padded rows, columns and channels are cut away, so results match the
unpadded op up to summation order (gradients too: they flow back through the
same pad and slice). Whether it pays is for measurement to decide.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

_multiple = int(os.environ.get("TPU_AGENT_PAD_OPS", "0") or 0)


def multiple() -> int:
    """The current multiple (0: off); part of every op's compile-cache key."""
    return _multiple


def set_multiple(value: int) -> None:
    global _multiple
    if value < 0:
        raise ValueError("the padding multiple must be >= 0")
    _multiple = int(value)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def matmul(a, b):
    """`a @ b` for a (..., M, K) and b (..., K, N), computed on padded shapes when enabled."""
    m = _multiple
    if not m or a.ndim < 2 or b.ndim < 2:
        return jnp.matmul(a, b)
    rows, inner, cols = a.shape[-2], a.shape[-1], b.shape[-1]
    pr, pk, pc = _up(rows, m), _up(inner, m), _up(cols, m)
    if (pr, pk, pc) == (rows, inner, cols):
        return jnp.matmul(a, b)
    a = _pad_axis(_pad_axis(a, a.ndim - 2, pr), a.ndim - 1, pk)
    b = _pad_axis(_pad_axis(b, b.ndim - 2, pk), b.ndim - 1, pc)
    return jnp.matmul(a, b)[..., :rows, :cols]


def conv(input, weight, run):
    """`run(input, weight)` (an ungrouped NC... x OI... convolution) on channel counts padded to the multiple."""
    m = _multiple
    c_out, c_in = weight.shape[0], weight.shape[1]
    po, pi = (_up(c_out, m), _up(c_in, m)) if m else (c_out, c_in)
    if (po, pi) == (c_out, c_in):
        return run(input, weight)
    out = run(_pad_axis(input, 1, pi), _pad_axis(_pad_axis(weight, 0, po), 1, pi))
    return out[:, :c_out]
