"""Pairwise distances: cdist, pdist."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ..core.registry import lower

aten = torch.ops.aten


def _pairwise(diff, p):
    """The p-norm over the last axis of pairwise differences, PyTorch's special p included."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype), axis=-1)
    if p == float("inf"):
        return jnp.max(a, axis=-1) if a.shape[-1] else jnp.zeros(a.shape[:-1], a.dtype)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a**p, axis=-1) ** (1.0 / p)


@lower(aten._cdist_forward.default, static_floats=True)
def cdist(x1, x2, p, compute_mode):
    r1, r2 = x1.shape[-2], x2.shape[-2]
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    # compute_mode: None / 0 = matmul form when either side has more than 25 rows, 1 = always, 2 = never.
    use_mm = p == 2 and (compute_mode == 1 or ((compute_mode is None or compute_mode == 0) and (r1 > 25 or r2 > 25)))
    if use_mm:
        # PyTorch's _euclidean_dist: |a|^2 - 2 a.b + |b|^2 as one matmul, clamped at 0.
        n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
        n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
        a = jnp.concatenate([-2 * x1, n1, jnp.ones_like(n1)], axis=-1)
        b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
        return jnp.sqrt(jnp.maximum(jnp.matmul(a, jnp.swapaxes(b, -1, -2)), 0))
    return _pairwise(x1[..., :, None, :] - x2[..., None, :, :], p)


@lower(aten._pdist_forward.default, static_floats=True)
def pdist(self, p=2.0):
    n = self.shape[0]
    i, j = np.triu_indices(n, 1)
    return _pairwise(self[jnp.asarray(i)] - self[jnp.asarray(j)], p)


def _pairwise_backward(diff, grad, dist, p):
    """d dist / d diff times grad, PyTorch's formula per p; grad and dist broadcast against
    diff's leading dims. Zero where the distance is zero (and for p < 1 where diff is)."""
    grad, dist = grad[..., None], dist[..., None]
    if p == 0:
        return jnp.zeros_like(diff)
    if p == 1:
        return grad * jnp.sign(diff)
    if p == float("inf"):
        return grad * jnp.sign(diff) * (jnp.abs(diff) == dist).astype(diff.dtype)
    zero = dist == 0
    safe_dist = jnp.where(zero, 1, dist)
    if p == 2:
        return jnp.where(zero, 0, grad * diff / safe_dist)
    a = jnp.abs(diff)
    if p < 2:
        bad = zero | ((diff == 0) & (p < 1))
        out = jnp.sign(diff) * jnp.where(bad, 1, a) ** (p - 1) * grad / safe_dist ** (p - 1)
        return jnp.where(bad, 0, out)
    return jnp.where(zero, 0, diff * a ** (p - 2) * grad / safe_dist ** (p - 1))


@lower(aten._cdist_backward.default, static_floats=True)
def cdist_backward(grad, x1, x2, p, cdist):
    """The gradient for x1 (autograd asks again with the operands swapped for x2), at the
    broadcast batch shape, as PyTorch's kernel returns it (x1's own shape when it is zero)."""
    if p == 0 or grad.size == 0 or x1.shape[-1] == 0 or x1.shape[-2] == 0:
        return jnp.zeros_like(x1)
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return jnp.sum(_pairwise_backward(diff, grad, cdist, p), axis=-2)


@lower(aten._pdist_backward.default, static_floats=True)
def pdist_backward(grad, self, p, pdist):
    i, j = (jnp.asarray(k) for k in np.triu_indices(self.shape[0], 1))
    g = _pairwise_backward(self[i] - self[j], grad, pdist, p)
    return jnp.zeros_like(self).at[i].add(g).at[j].add(-g)
