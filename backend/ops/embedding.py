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
