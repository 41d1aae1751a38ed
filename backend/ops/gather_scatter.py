"""Indexing at tensor positions: advanced indexing, index_put, gathers and scatters (with their reductions),
index_add / copy / fill / reduce, masked_scatter, put and take. Their backwards are in indexing.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..core.registry import lower
from ._util import norm_dim

aten = torch.ops.aten


# --- indexing --------------------------------------------------------------------


def _index_tuple(self, indices):
    out = []
    for idx in indices:
        if idx is None:
            out.append(slice(None))
        elif idx.dtype == jnp.bool_:
            raise NotImplementedError("boolean mask indexing has a data-dependent shape")
        else:
            out.append(idx)
    return tuple(out)


@jax.jit
def _index_int(self, indices):
    return self[_index_tuple(self, indices)]


def _has_mask(self, indices):
    return any(i is not None and i.dtype == torch.bool for i in indices)


# A boolean mask's result size is its number of Trues: such calls run unjitted (masks become
# integer indices on the host, then the jitted integer gather runs); integer indexing is jitted.
@lower(aten.index.Tensor, eager_if=_has_mask)
def index(self, indices):
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        return _index_bool(self, indices)
    return _index_int(self, list(indices))


def _index_bool(self, indices):
    expanded = []
    for idx in indices:
        if idx is not None and idx.dtype == jnp.bool_:
            expanded.extend(jnp.asarray(i) for i in np.nonzero(np.asarray(idx)))
        else:
            expanded.append(idx)
    return _index_int(self, expanded)


@lower(aten.index_put.default)
def index_put(self, indices, values, accumulate=False):
    bools = [i for i in indices if i is not None and i.dtype == jnp.bool_]
    if len(bools) == 1 and all(i is None or i is bools[0] for i in indices):
        return _index_put_mask(self, indices, values, accumulate)
    idx = []
    for i in indices:
        if i is not None and i.dtype == jnp.bool_:
            idx.extend(jnp.nonzero(i))
        else:
            idx.append(slice(None) if i is None else i)
    ref = self.at[tuple(idx)]
    values = values.astype(self.dtype)
    return ref.add(values) if accumulate else ref.set(values)


def _index_put_mask(self, indices, values, accumulate):
    """`self[..., mask, ...] = values` with static shapes: the k-th True takes values[k]."""
    p = next(n for n, i in enumerate(indices) if i is not None)
    mask = indices[p]
    pre, post = self.shape[:p], self.shape[p + mask.ndim:]
    rank = len(pre) + 1 + len(post)
    values = values.astype(self.dtype)
    values = values.reshape((1,) * (rank - values.ndim) + values.shape)
    if values.shape[len(pre)] == 0:
        return self
    if values.shape[len(pre)] == 1:
        v = values.reshape(values.shape[: len(pre)] + (1,) * mask.ndim + values.shape[len(pre) + 1:])
    else:
        order = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, values.shape[len(pre)] - 1)
        v = jnp.take(values, order, axis=len(pre))
        v = v.reshape(v.shape[: len(pre)] + mask.shape + v.shape[len(pre) + 1:])
    full = mask.reshape((1,) * len(pre) + mask.shape + (1,) * len(post))
    return jnp.where(full, self + v if accumulate else v, self)


@lower(aten.index_select.default)
def index_select(self, dim, index):
    if self.ndim == 0:
        return self
    return jnp.take(self, index, axis=norm_dim(dim, self.ndim))


@lower(aten.gather.default)
def gather(self, dim, index, *, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    if self.ndim == 0:
        return jnp.broadcast_to(self, index.shape)
    d = norm_dim(dim, self.ndim)
    # The index may be smaller than self along the other dims: only that corner is read.
    self = self[tuple(slice(None) if i == d else slice(0, n) for i, n in enumerate(index.shape))]
    return jnp.take_along_axis(self, index, axis=d, mode="clip")


def _scatter_indices(self, dim, index):
    dim = norm_dim(dim, self.ndim)
    grids = jnp.meshgrid(*[jnp.arange(s) for s in index.shape], indexing="ij")
    grids[dim] = index
    return tuple(grids)


@lower(aten.scatter.src, aten.scatter.value)
def scatter(self, dim, index, src):
    if self.ndim == 0:
        return jnp.asarray(src, self.dtype).reshape(()) if index.size else self
    if not hasattr(src, "shape") or src.ndim == 0:
        src = jnp.broadcast_to(jnp.asarray(src, self.dtype), index.shape)
    src = src[tuple(slice(0, s) for s in index.shape)]
    return self.at[_scatter_indices(self, dim, index)].set(src.astype(self.dtype))


@lower(aten.scatter_add.default)
def scatter_add(self, dim, index, src):
    if index.size == 0:  # an empty index (its rank may differ from self's) adds nothing
        return self
    if self.ndim == 0:
        return self + src.reshape(()).astype(self.dtype)
    src = src[tuple(slice(0, s) for s in index.shape)]
    return self.at[_scatter_indices(self, dim, index)].add(src.astype(self.dtype))


@lower(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(self, dim, index, src, *, reduce):
    if not hasattr(src, "shape") or src.ndim == 0:
        src = jnp.broadcast_to(jnp.asarray(src, self.dtype), index.shape)
    src = src[tuple(slice(0, s) for s in index.shape)].astype(self.dtype)
    ref = self.at[_scatter_indices(self, dim, index)]
    return ref.add(src) if reduce == "add" else ref.multiply(src)


@lower(aten.scatter_reduce.two)
def scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    src = src[tuple(slice(0, s) for s in index.shape)].astype(self.dtype)
    idx = _scatter_indices(self, dim, index)
    if reduce == "sum":
        base = self if include_self else self.at[idx].set(0)
        return base.at[idx].add(src)
    if reduce == "prod":
        base = self if include_self else self.at[idx].set(1)
        return base.at[idx].multiply(src)
    if reduce in ("amax", "amin"):
        fill = -jnp.inf if reduce == "amax" else jnp.inf
        if not jnp.issubdtype(self.dtype, jnp.floating):
            info = jnp.iinfo(self.dtype)
            fill = info.min if reduce == "amax" else info.max
        base = self if include_self else self.at[idx].set(fill)
        return base.at[idx].max(src) if reduce == "amax" else base.at[idx].min(src)
    if reduce == "mean":
        base = self if include_self else self.at[idx].set(0)
        total = base.at[idx].add(src)
        count = jnp.ones_like(self) if include_self else jnp.zeros_like(self).at[idx].set(0)
        count = count.at[idx].add(jnp.ones_like(src))
        out = total / jnp.maximum(count, 1)
        return out.astype(self.dtype) if jnp.issubdtype(self.dtype, jnp.floating) else jnp.floor_divide(total, jnp.maximum(count, 1)).astype(self.dtype)
    raise NotImplementedError(f"scatter_reduce with reduce={reduce!r}")


@lower(aten.index_add.default)
def index_add(self, dim, index, source, *, alpha=1):
    dim = norm_dim(dim, self.ndim) if self.ndim else 0
    if self.ndim == 0:
        return self + alpha * source.reshape(())
    idx = [slice(None)] * self.ndim
    idx[dim] = index
    moved = source * alpha
    return self.at[tuple(idx)].add(moved.astype(self.dtype))


@lower(aten.index_copy.default)
def index_copy(self, dim, index, source):
    if self.ndim == 0:
        return source.reshape(()).astype(self.dtype)
    idx = [slice(None)] * self.ndim
    idx[norm_dim(dim, self.ndim)] = index
    return self.at[tuple(idx)].set(source.astype(self.dtype))


@lower(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(self, dim, index, value):
    if self.ndim == 0:
        return jnp.full((), value, self.dtype)
    idx = [slice(None)] * self.ndim
    idx[norm_dim(dim, self.ndim)] = index
    return self.at[tuple(idx)].set(jnp.asarray(value, self.dtype))


# --- more indexing: reductions into an index, masks, flat positions -----------------


@lower(aten.index_reduce.default)
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    if self.ndim == 0:
        out = index_reduce(self.reshape(1), 0, index.reshape(-1), source.reshape(1), reduce, include_self=include_self)
        return out.reshape(())
    d = norm_dim(dim, self.ndim)
    x = jnp.moveaxis(self, d, 0)
    src = jnp.moveaxis(source.astype(self.dtype), d, 0)
    if reduce == "prod":
        base = x if include_self else x.at[index].set(1)
        out = base.at[index].multiply(src)
    elif reduce in ("amax", "amin"):
        if jnp.issubdtype(x.dtype, jnp.floating):
            fill = -jnp.inf if reduce == "amax" else jnp.inf
        else:
            info = jnp.iinfo(x.dtype)
            fill = info.min if reduce == "amax" else info.max
        base = x if include_self else x.at[index].set(fill)
        out = base.at[index].max(src) if reduce == "amax" else base.at[index].min(src)
    elif reduce == "mean":
        base = x if include_self else x.at[index].set(0)
        total = base.at[index].add(src)
        count = jnp.zeros(x.shape[:1], x.dtype).at[index].add(1) + (1 if include_self else 0)
        count = jnp.maximum(count, 1).reshape((-1,) + (1,) * (x.ndim - 1))
        out = total / count if jnp.issubdtype(x.dtype, jnp.floating) else jnp.floor_divide(total, count)
    else:
        raise NotImplementedError(f"index_reduce with reduce={reduce!r}")
    return jnp.moveaxis(out, 0, d).astype(self.dtype)


@lower(aten.masked_scatter.default)
def masked_scatter(self, mask, source):
    """Fill the True positions of `mask`, in row-major order, from consecutive `source` elements."""
    self, mask = jnp.broadcast_arrays(self, mask)
    flat = source.reshape(-1).astype(self.dtype)
    if flat.size == 0:
        return self
    order = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, flat.size - 1)
    return jnp.where(mask, flat[order].reshape(self.shape), self)


def _flat_index(index, n):
    index = index.reshape(-1)
    return jnp.where(index < 0, index + n, index)


@lower(aten.put.default)
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    idx = _flat_index(index, flat.size)
    src = source.reshape(-1).astype(self.dtype)
    out = flat.at[idx].add(src) if accumulate else flat.at[idx].set(src)
    return out.reshape(self.shape)


@lower(aten.take.default)
def take(self, index):
    flat = self.reshape(-1)
    return flat[_flat_index(index, flat.size)].reshape(index.shape)
