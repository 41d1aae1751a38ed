"""Tensor creation: allocation (zero-filled), constants, ranges, copies."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ..core.registry import lower
from ._util import default_float, jdtype

aten = torch.ops.aten


def _dtype_of(dtype, fallback):
    return jdtype(dtype, fallback)


# Memory a program never reads needs no value; zeros make "uninitialised" deterministic.
# _efficientzerotensor is autograd's zero gradient (sgn's, for real inputs): dense zeros here.
@lower(aten.empty.memory_format, aten.zeros.default, aten._efficientzerotensor.default)
def empty(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), _dtype_of(dtype, default_float()))


@lower(aten.empty_strided.default)
def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype_of(dtype, default_float()))


@lower(aten.ones.default)
def ones(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype_of(dtype, default_float()))


@lower(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, _dtype_of(dtype, None))


@lower(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(s, _dtype_of(dtype, default_float()))


@lower(aten.empty_like.default, aten.zeros_like.default)
def zeros_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(self.shape, _dtype_of(dtype, self.dtype))


@lower(aten.ones_like.default)
def ones_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(self.shape, _dtype_of(dtype, self.dtype))


@lower(aten.full_like.default)
def full_like(self, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(self.shape, fill_value, _dtype_of(dtype, self.dtype))


@lower(aten.new_empty.default, aten.new_zeros.default)
def new_zeros(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype_of(dtype, self.dtype))


@lower(aten.new_empty_strided.default)
def new_empty_strided(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dtype_of(dtype, self.dtype))


@lower(aten.new_ones.default)
def new_ones(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dtype_of(dtype, self.dtype))


@lower(aten.new_full.default)
def new_full(self, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fill_value, _dtype_of(dtype, self.dtype))


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(self, value):
    return jnp.full(self.shape, value, self.dtype)


@lower(aten.zero.default)
def zero(self):
    return jnp.zeros_like(self)


@lower(aten.clone.default)
def clone(self, *, memory_format=None):
    return jnp.array(self, copy=True)


@lower(aten._unsafe_view.default)
def unsafe_view(self, size):
    return jnp.reshape(self, tuple(size))


# Ranges: their length depends on the values, so the values are compile-time constants.
@lower(aten.arange.default, static_floats=True)
def arange(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.arange(end, dtype=_dtype_of(dtype, None))


@lower(aten.arange.start, static_floats=True)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.arange(start, end, dtype=_dtype_of(dtype, None))


@lower(aten.arange.start_step, static_floats=True)
def arange_start_step(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    n = int(np.ceil((end - start) / step))
    want = _dtype_of(dtype, None)
    values = start + jnp.arange(max(n, 0), dtype=jnp.float64 if want is None or jnp.issubdtype(want, jnp.floating) else jnp.int64) * step
    return values if want is None else values.astype(want)


@lower(aten.linspace.default, static_floats=True)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.linspace(start, end, steps, dtype=_dtype_of(dtype, default_float()))


@lower(aten.logspace.default, static_floats=True)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.logspace(start, end, steps, base=base, dtype=_dtype_of(dtype, default_float()))


@lower(aten.eye.default)
def eye(n, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, dtype=_dtype_of(dtype, default_float()))


@lower(aten.eye.m)
def eye_m(n, m, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, m, dtype=_dtype_of(dtype, default_float()))


@lower(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    r, c = np.tril_indices(row, offset, col)
    return jnp.asarray(np.stack([r, c]), _dtype_of(dtype, jnp.int64))


@lower(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    r, c = np.triu_indices(row, offset, col)
    return jnp.asarray(np.stack([r, c]), _dtype_of(dtype, jnp.int64))
