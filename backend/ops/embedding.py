"""Embeddings: the lookup and its dense backward, and embedding bags (renorm is with the gathers, in shape.py).

The lookup's own JAX gradient must be PyTorch's: a compiled step differentiates the forward with JAX
(module_program.py) rather than calling `embedding_dense_backward`, and there a plain gather sent
gradient into the `padding_idx` row, wherever a real token shared the pad token's id (issue #28: a Llama
with one such token drifted 1.2e-4 from the CPU by step 15).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core.registry import lower

aten = torch.ops.aten


@lower(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    rows = jnp.take(weight, indices, axis=0)
    if scale_grad_by_freq:
        # The same values; the gradient divided by each index's count, as embedding_dense_backward's.
        flat = indices.reshape(-1)
        counts = jnp.zeros((weight.shape[0],), rows.dtype).at[flat].add(1)
        fixed = jax.lax.stop_gradient(rows)
        rows = fixed + (rows - fixed) / counts[indices][..., None]
    if padding_idx >= 0:
        # The same values; no gradient reaches the padding row.
        rows = jnp.where((indices == padding_idx)[..., None], jax.lax.stop_gradient(rows), rows)
    return rows


@lower(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    flat_idx = indices.reshape(-1)
    grad = grad_output.reshape(flat_idx.shape[0], -1)
    if padding_idx >= 0:
        grad = jnp.where((flat_idx == padding_idx)[:, None], 0, grad)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), grad.dtype).at[flat_idx].add(1)
        grad = grad / counts[flat_idx][:, None]
    out = jnp.zeros((num_weights, grad.shape[1]), grad_output.dtype)
    return out.at[flat_idx].add(grad)


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
