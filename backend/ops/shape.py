"""Views, shape changes, joins, indexing, gathers and scatters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..registry import lower
from ._util import norm_dim, norm_dims

aten = torch.ops.aten


def _infer_shape(size, numel):
    size = list(size)
    if -1 in size:
        i = size.index(-1)
        known = int(np.prod([s for j, s in enumerate(size) if j != i]))
        size[i] = numel // known if known else 0
    return tuple(size)


# --- views (the dispatcher links their results to the base's storage) -------------


@lower(aten.view.default, aten._reshape_alias.default)
def view(self, size, stride=None):
    return jnp.reshape(self, _infer_shape(size, self.size))


@lower(aten.alias.default, aten.detach.default, aten.lift_fresh.default, aten.view_as.default)
def alias(self, other=None):
    return self if other is None else jnp.reshape(self, other.shape)


@lower(aten.view.dtype)
def view_dtype(self, dtype):
    from ..dtypes import to_jax_dtype

    return lax.bitcast_convert_type(self, to_jax_dtype(dtype)) if jnp.dtype(to_jax_dtype(dtype)).itemsize == self.dtype.itemsize else _bitcast_resize(self, to_jax_dtype(dtype))


def _bitcast_resize(x, dtype):
    raise NotImplementedError("aten.view.dtype between dtypes of different sizes is not supported on tpu")


@lower(aten.t.default)
def t(self):
    return self.T if self.ndim == 2 else self


@lower(aten.transpose.int)
def transpose(self, dim0, dim1):
    if self.ndim == 0:
        return self
    return jnp.swapaxes(self, norm_dim(dim0, self.ndim), norm_dim(dim1, self.ndim))


@lower(aten.permute.default)
def permute(self, dims):
    return jnp.transpose(self, tuple(norm_dim(d, self.ndim) for d in dims))


@lower(aten.expand.default)
def expand(self, size, *, implicit=False):
    size = list(size)
    lead = len(size) - self.ndim
    shape = [self.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    return jnp.broadcast_to(self, tuple(shape))


@lower(aten.unsqueeze.default)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, norm_dim(dim, self.ndim + 1))


@lower(aten.squeeze.default)
def squeeze(self):
    return jnp.squeeze(self)


@lower(aten.squeeze.dim, aten.squeeze.dims)
def squeeze_dims(self, dim):
    if self.ndim == 0 or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return self
    dims = norm_dims(dim, self.ndim)
    return jnp.squeeze(self, tuple(d for d in dims if self.shape[d] == 1))


def _clip_slice(start, end, step, length):
    start = 0 if start is None else start
    end = length if end is None else end
    return slice(*slice(start, end, step).indices(length))


@lower(aten.slice.Tensor)
def slice_(self, dim=0, start=None, end=None, step=1):
    dim = norm_dim(dim, self.ndim)
    s = _clip_slice(start, end, step, self.shape[dim])
    index = [slice(None)] * self.ndim
    index[dim] = s
    return self[tuple(index)]


@lower(aten.select.int)
def select(self, dim, index):
    dim = norm_dim(dim, self.ndim)
    if not -self.shape[dim] <= index < self.shape[dim]:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {self.shape[dim]}")
    return lax.index_in_dim(self, index % self.shape[dim], dim, keepdims=False)


@lower(aten.narrow.default)
def narrow(self, dim, start, length):
    dim = norm_dim(dim, self.ndim)
    start = start % self.shape[dim] if start < 0 else start
    return lax.slice_in_dim(self, start, start + length, axis=dim)


@lower(aten.diagonal.default)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, norm_dim(dim1, self.ndim), norm_dim(dim2, self.ndim))


@lower(aten.as_strided.default)
def as_strided(self, size, stride, storage_offset=None):
    flat = jnp.ravel(self)
    index = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        index = index + (np.arange(n) * s).reshape(shape)
    return flat[jnp.asarray(index)] if index.size else jnp.zeros(tuple(size), self.dtype)


@lower(aten.unfold.default)
def unfold(self, dimension, size, step):
    if self.ndim == 0:
        return jnp.reshape(self, (1,))
    dim = norm_dim(dimension, self.ndim)
    n = (self.shape[dim] - size) // step + 1
    starts = np.arange(n) * step
    idx = starts[:, None] + np.arange(size)[None, :]
    taken = jnp.take(self, jnp.asarray(idx), axis=dim)  # (..., n, size, ...)
    return jnp.moveaxis(taken, dim + 1, -1)


@lower(aten.split.Tensor)
def split(self, split_size, dim=0):
    dim = norm_dim(dim, self.ndim)
    n = self.shape[dim]
    bounds = list(range(0, n, split_size)) if split_size else [0]
    return [lax.slice_in_dim(self, b, min(b + split_size, n), axis=dim) for b in bounds] or [self]


@lower(aten.split_with_sizes.default)
def split_with_sizes(self, split_sizes, dim=0):
    dim = norm_dim(dim, self.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(self, start, start + s, axis=dim))
        start += s
    return out


@lower(aten.unbind.int)
def unbind(self, dim=0):
    dim = norm_dim(dim, self.ndim)
    return [lax.index_in_dim(self, i, dim, keepdims=False) for i in range(self.shape[dim])]


@lower(aten.view_as_real.default)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lower(aten.view_as_complex.default)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


# --- copies that change shape -------------------------------------------------


@lower(aten.cat.default)
def cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors)[:1]
    dtype = jnp.result_type(*tensors)
    return jnp.concatenate([t.astype(dtype) for t in tensors], axis=norm_dim(dim, tensors[0].ndim))


@lower(aten.stack.default)
def stack(tensors, dim=0):
    return jnp.stack(tensors, axis=norm_dim(dim, tensors[0].ndim + 1))


@lower(aten.flip.default)
def flip(self, dims):
    return jnp.flip(self, norm_dims(dims, self.ndim)) if len(dims) else self


@lower(aten.roll.default)
def roll(self, shifts, dims=()):
    if not dims:
        return jnp.roll(self.ravel(), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), tuple(norm_dim(d, self.ndim) for d in dims))


@lower(aten.repeat.default)
def repeat(self, repeats):
    lead = len(repeats) - self.ndim
    x = jnp.reshape(self, (1,) * lead + self.shape)
    return jnp.tile(x, tuple(repeats))


@lower(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@lower(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


@lower(aten.constant_pad_nd.default)
def constant_pad_nd(self, pad, value=0):
    config = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        d = self.ndim - 1 - i
        config[d] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value, self.dtype), config)


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    return jnp.where(mask, jnp.asarray(value).astype(self.dtype), self)


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


# --- data-dependent shapes (run on concrete arrays, not jitted) --------------------


@lower(aten.nonzero.default, jit=False)
def nonzero(self):
    return jnp.stack(jnp.nonzero(self), axis=-1) if self.ndim else jnp.zeros((int(bool(self)), 0), jnp.int64)


@lower(aten.masked_select.default, jit=False)
def masked_select(self, mask):
    self, mask = jnp.broadcast_arrays(self, mask)
    return self[mask]


@lower(aten.unique_consecutive.default, jit=False)
def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    flat = np.asarray(self).ravel() if dim is None else None
    if flat is None:
        raise NotImplementedError("unique_consecutive with dim")
    keep = np.ones(flat.shape, bool)
    keep[1:] = flat[1:] != flat[:-1]
    values = flat[keep]
    inverse = np.cumsum(keep) - 1
    counts = np.diff(np.append(np.nonzero(keep)[0], flat.size))
    return jnp.asarray(values), jnp.asarray(inverse.reshape(self.shape)), jnp.asarray(counts)


@lower(aten._unique2.default, jit=False)
def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    values, inverse, counts = np.unique(np.asarray(self), return_inverse=True, return_counts=True)
    return jnp.asarray(values), jnp.asarray(inverse.reshape(self.shape)), jnp.asarray(counts)


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


@lower(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    coords = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(coords, axis=-1).astype(jnp.int64)


def _scatter_positions(self, view):
    """Scatter `value` into the positions of `self` that the view function selects."""
    def scatter(value):
        positions = view(jnp.arange(self.size).reshape(self.shape))
        value = jnp.broadcast_to(value, positions.shape).astype(self.dtype)
        return self.reshape(-1).at[positions.reshape(-1)].set(value.reshape(-1)).reshape(self.shape)

    return scatter


@lower(aten.diagonal_scatter.default)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    return _scatter_positions(self, lambda a: jnp.diagonal(a, offset, norm_dim(dim1, a.ndim), norm_dim(dim2, a.ndim)))(src)


@lower(aten.as_strided_scatter.default)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    return _scatter_positions(self, lambda a: as_strided(a, size, stride, storage_offset))(src)


@lower(aten.copy.default)
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(src, self.shape).astype(self.dtype)


@lower(aten.embedding_renorm.default)
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rescale the rows named by `indices` whose norm exceeds max_norm (as PyTorch: by max_norm / (norm + 1e-7))."""
    idx = indices.reshape(-1)
    rows = self[idx]
    norms = jnp.sum(jnp.abs(rows) ** norm_type, axis=-1, keepdims=True) ** (1.0 / norm_type)
    scale = jnp.where(norms > max_norm, max_norm / (norms + 1e-7), 1.0)
    return self.at[idx].set((rows * scale).astype(self.dtype))


@lower(aten.repeat_interleave.Tensor, jit=False)
def repeat_interleave(repeats, *, output_size=None):
    # The output length is the sum of `repeats`: a value, hence unjitted.
    total = int(jnp.sum(repeats)) if output_size is None else output_size
    return jnp.repeat(jnp.arange(repeats.shape[0]), repeats, total_repeat_length=total)
