"""Views, shape changes, joins, ops whose output shape depends on the data, and scatters into a view's
positions (indexing, gathers and scatters: gather_scatter.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..core.registry import lower
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
    from ..core.dtypes import to_jax_dtype

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


@lower(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    coords = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(coords, axis=-1).astype(jnp.int64)


# --- scatters into a view's positions, copies, embedding renorm, repeat_interleave ------


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
