"""Backwards of indexing ops (their forwards are with the gathers and scatters, in gather_scatter.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ..core.registry import lower

aten = torch.ops.aten


@lower(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    """The gradient of masked_scatter's source: grad_output at mask's True positions, in
    row-major order, then zeros, shaped like the source."""
    grad, mask = jnp.broadcast_arrays(grad_output, mask)
    n = int(np.prod(sizes))
    flat_mask = mask.reshape(-1)
    slot = jnp.where(flat_mask, jnp.cumsum(flat_mask) - 1, n)  # n: past the end, dropped
    out = jnp.zeros((n,), grad_output.dtype).at[slot].set(grad.reshape(-1), mode="drop")
    return out.reshape(tuple(sizes))


@lower(aten._unique.default, jit=False)
def unique(self, sorted=True, return_inverse=False):
    """Sorted unique values (also for sorted=False, whose order PyTorch leaves open) and, when
    asked, each element's position among them (else an empty inverse, as PyTorch's)."""
    values, inverse = np.unique(np.asarray(self), return_inverse=True)
    inverse = inverse.reshape(self.shape) if return_inverse else np.zeros((0,), np.int64)
    return jnp.asarray(values), jnp.asarray(inverse, jnp.int64)
