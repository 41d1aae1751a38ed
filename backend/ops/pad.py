"""Padding backwards (PyTorch decomposes the pad forwards): the VJP of the same pad in JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core.registry import lower

aten = torch.ops.aten


def _edge_pad(x, padding):
    """Replication padding of the last len(padding) // 2 dims; padding lists (left, right)
    per dim from the last dim backwards, as PyTorch's; negative entries crop."""
    nd = len(padding) // 2
    widths = [(0, 0)] * (x.ndim - nd) + [(padding[2 * i], padding[2 * i + 1]) for i in reversed(range(nd))]
    grow = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    x = jnp.pad(x, grow, mode="edge")
    crop = tuple(slice(max(-lo, 0), x.shape[d] - max(-hi, 0)) for d, (lo, hi) in enumerate(widths))
    return x[crop]


def _edge_pad_backward(grad_output, self, padding):
    _, vjp = jax.vjp(lambda x: _edge_pad(x, padding), self)
    return vjp(grad_output)[0]


@lower(aten.replication_pad1d_backward.default, aten.replication_pad2d_backward.default,
       aten.replication_pad3d_backward.default)
def replication_pad_backward(grad_output, self, padding):
    return _edge_pad_backward(grad_output, self, padding)
