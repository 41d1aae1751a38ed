"""Embedding bags (the lookup, its dense backward and renorm are with the gathers, in shape.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..registry import lower

aten = torch.ops.aten


@lower(aten._embedding_bag_forward_only.default, aten._embedding_bag.default)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """Bags of embedding rows reduced by sum (0), mean (1) or max (2). Returns the output,
    each index's bag, each bag's size and (for max) the row index chosen per feature."""
    if indices.ndim == 2:  # fixed-size bags given as a matrix
        bags, per = indices.shape
        offsets = jnp.arange(bags) * per
        indices = indices.reshape(-1)
        include_last_offset = False
    n = indices.shape[0]
    bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    bag_of = jnp.searchsorted(offsets, jnp.arange(n), side="right") - 1
    if include_last_offset:
        bag_of = jnp.minimum(bag_of, bags - 1)
    keep = indices != padding_idx if padding_idx >= 0 else jnp.ones((n,), bool)
    rows = weight[indices]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    seg = jnp.where(keep, bag_of, bags)  # padding goes to a dropped extra segment
    counts = jax.ops.segment_sum(keep.astype(jnp.int64), seg, num_segments=bags + 1)[:bags]
    if mode == 2:
        out = jax.ops.segment_max(rows, seg, num_segments=bags + 1)[:bags]
        out = jnp.where(counts[:, None] > 0, out, 0)
        # The first position reaching the max, per bag and feature.
        hit = (rows == out[jnp.minimum(seg, bags - 1)]) & (seg < bags)[:, None]
        first = jax.ops.segment_min(jnp.where(hit, jnp.arange(n)[:, None], n), seg, num_segments=bags + 1)[:bags]
        max_indices = jnp.where(counts[:, None] > 0, indices[jnp.minimum(first, n - 1)], 0).astype(jnp.int64)
    else:
        out = jax.ops.segment_sum(rows, seg, num_segments=bags + 1)[:bags]
        if mode == 1:
            out = out / jnp.maximum(counts, 1)[:, None].astype(out.dtype)
        max_indices = jnp.zeros((0,), jnp.int64)
    # bag_size has one entry per offset (include_last_offset's extra one is 0), as PyTorch's.
    bag_size = jnp.concatenate([counts, jnp.zeros((offsets.shape[0] - bags,), counts.dtype)])
    return out.astype(weight.dtype), bag_of.astype(jnp.int64), bag_size, max_indices


@lower(aten._embedding_bag_dense_backward.default)
def embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                 scale_grad_by_freq, mode, per_sample_weights=None, padding_idx=-1):
    """The weight's gradient: each bag's output gradient back to the rows it reduced (sum,
    mean: divided by the bag's size) or, for max, to the row chosen per feature."""
    dim = grad.shape[-1]
    out = jnp.zeros((num_weights, dim), grad.dtype)
    if mode == 2:
        rows = jnp.where((bag_size > 0)[:, None], maximum_indices, num_weights)  # empty bags: dropped
        cols = jnp.broadcast_to(jnp.arange(dim), rows.shape)
        return out.at[rows, cols].add(grad, mode="drop")
    idx = indices.reshape(-1)
    g = grad[offset2bag]
    if per_sample_weights is not None:
        g = g * per_sample_weights[:, None].astype(g.dtype)
    if mode == 1:
        g = g / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(g.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    rows = jnp.where(idx == padding_idx, num_weights, idx) if padding_idx >= 0 else idx
    return out.at[rows].add(g, mode="drop")


@lower(aten._embedding_bag_backward.default)
def embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                           scale_grad_by_freq, mode, sparse, per_sample_weights=None, padding_idx=-1):
    if sparse:
        raise NotImplementedError("embedding_bag with sparse=True: sparse gradients are not supported on tpu")
    return embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                        scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lower(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    idx = indices.reshape(-1)
    out = jnp.sum(grad[offset2bag] * weight[idx], axis=-1)
    return jnp.where(idx == padding_idx, 0, out) if padding_idx >= 0 else out
