"""Reductions, scans, sorting and softmax (order statistics, histograms and searching: statistics.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core.registry import lower
from ._util import jdtype, norm_dim, norm_dims

aten = torch.ops.aten


def _acc_dtype(x, dtype):
    if dtype is not None:
        return jdtype(dtype)
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.int64
    return None


@lower(aten.sum.default)
def sum_(self, *, dtype=None):
    return jnp.sum(self, dtype=_acc_dtype(self, dtype))


@lower(aten.sum.dim_IntList)
def sum_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.sum(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim, dtype=_acc_dtype(self, dtype))


@lower(aten.mean.default)
def mean(self, *, dtype=None):
    return jnp.mean(self, dtype=jdtype(dtype))


@lower(aten.mean.dim)
def mean_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.mean(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim, dtype=jdtype(dtype))


@lower(aten.prod.default)
def prod(self, *, dtype=None):
    return jnp.prod(self, dtype=_acc_dtype(self, dtype))


@lower(aten.prod.dim_int)
def prod_dim(self, dim, keepdim=False, *, dtype=None):
    return jnp.prod(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim, dtype=_acc_dtype(self, dtype))


@lower(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@lower(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@lower(aten.max.default)
def max_(self):
    return jnp.max(self)


@lower(aten.min.default)
def min_(self):
    return jnp.min(self)


@lower(aten.max.other, aten.maximum.default)
def max_other(self, other):
    return jnp.maximum(self, other)


@lower(aten.min.other, aten.minimum.default)
def min_other(self, other):
    return jnp.minimum(self, other)


def _arg_extreme(self, dim, keepdim, pick):
    if self.ndim == 0:
        return jnp.zeros((), jnp.int64)
    if dim is None:
        out = pick(self.ravel())
        return jnp.reshape(out, (1,) * self.ndim) if keepdim else out
    return pick(self, axis=norm_dim(dim, self.ndim), keepdims=keepdim)


@lower(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg_extreme(self, dim, keepdim, jnp.argmax)


@lower(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg_extreme(self, dim, keepdim, jnp.argmin)


@lower(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    return jnp.max(self, axis=d, keepdims=keepdim), jnp.argmax(self, axis=d, keepdims=keepdim)


@lower(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    return jnp.min(self, axis=d, keepdims=keepdim), jnp.argmin(self, axis=d, keepdims=keepdim)


@lower(aten.any.default)
def any_(self):
    return jnp.any(self)


@lower(aten.any.dim, aten.any.dims)
def any_dim(self, dim=None, keepdim=False):
    return jnp.any(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@lower(aten.all.default)
def all_(self):
    return jnp.all(self)


@lower(aten.all.dim, aten.all.dims)
def all_dim(self, dim=None, keepdim=False):
    return jnp.all(self, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@lower(aten.var.correction)
def var(self, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return jnp.var(self, axis=norm_dims(dim, self.ndim), ddof=ddof, keepdims=keepdim)


@lower(aten.std.correction)
def std(self, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    return jnp.std(self, axis=norm_dims(dim, self.ndim), ddof=ddof, keepdims=keepdim)


@lower(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    axes = norm_dims(dim, self.ndim)
    return jnp.var(self, axis=axes, ddof=ddof, keepdims=keepdim), jnp.mean(self, axis=axes, keepdims=keepdim)


@lower(aten.std_mean.correction)
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    axes = norm_dims(dim, self.ndim)
    return jnp.std(self, axis=axes, ddof=ddof, keepdims=keepdim), jnp.mean(self, axis=axes, keepdims=keepdim)


@lower(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    x = self if jnp.issubdtype(self.dtype, jnp.inexact) else self.astype(jnp.float32)
    return jax.scipy.special.logsumexp(x, axis=norm_dims(dim, self.ndim), keepdims=keepdim)


@lower(aten.linalg_vector_norm.default, static_floats=True)
def vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = jnp.abs(self.astype(jdtype(dtype, self.dtype)))
    axes = norm_dims(dim, self.ndim)
    if ord == float("inf"):
        return jnp.max(x, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(x, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(x, axis=axes, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    return jnp.sum(x**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)


@lower(aten.count_nonzero.dim_IntList, aten.count_nonzero.default)
def count_nonzero(self, dim=None):
    return jnp.count_nonzero(self, axis=norm_dims(dim, self.ndim) if dim is not None else None)


# --- scans ---------------------------------------------------------------------------


@lower(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    if self.ndim == 0:
        return self.astype(_acc_dtype(self, dtype) or self.dtype)
    return jnp.cumsum(self, axis=norm_dim(dim, self.ndim), dtype=_acc_dtype(self, dtype))


@lower(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    if self.ndim == 0:
        return self.astype(_acc_dtype(self, dtype) or self.dtype)
    return jnp.cumprod(self, axis=norm_dim(dim, self.ndim), dtype=_acc_dtype(self, dtype))


def _cum_extreme(self, dim, op):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    n = self.shape[d]
    idx = lax.broadcasted_iota(jnp.int64, self.shape, d)

    def combine(a, b):
        va, ia = a
        vb, ib = b
        take_b = op(vb, va) | (vb == va) | jnp.isnan(vb)
        take_b = take_b & ~(jnp.isnan(va) & ~jnp.isnan(vb))
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    del n
    return lax.associative_scan(combine, (self, idx), axis=d)


@lower(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, jnp.greater)


@lower(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, jnp.less)


@lower(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    if self.ndim == 0:
        return self
    return lax.cumlogsumexp(self, axis=norm_dim(dim, self.ndim))


# --- sorting ----------------------------------------------------------------------


@lower(aten.sort.default, aten.sort.stable)
def sort(self, dim=-1, descending=False, *, stable=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    key = -self if descending and not jnp.issubdtype(self.dtype, jnp.bool_) else self
    if descending and self.dtype == jnp.bool_:
        key = ~self
    idx = jnp.argsort(key, axis=d, stable=True)
    return jnp.take_along_axis(self, idx, axis=d), idx


@lower(aten.argsort.default, aten.argsort.stable)
def argsort(self, dim=-1, descending=False, *, stable=False):
    return sort(self, dim, descending)[1]


@lower(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    x = jnp.moveaxis(self, d, -1)
    values, idx = lax.top_k(x if largest else -x, k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, d), jnp.moveaxis(idx.astype(jnp.int64), -1, d)


@lower(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    idx = jnp.argsort(self, axis=d, stable=True)
    pick = jnp.take(idx, jnp.asarray([k - 1]), axis=d)
    values = jnp.take_along_axis(self, pick, axis=d)
    if not keepdim:
        values, pick = jnp.squeeze(values, d), jnp.squeeze(pick, d)
    return values, pick


# --- softmax -------------------------------------------------------------------------


def _f32(x):
    """bfloat16 and float16 as float32: PyTorch's softmax kernels compute in float32 and round once."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


@lower(aten._softmax.default)
def softmax(self, dim, half_to_float=False):
    if self.ndim == 0:
        return jnp.ones_like(self)
    out = jax.nn.softmax(_f32(self), axis=norm_dim(dim, self.ndim))
    return out if half_to_float else out.astype(self.dtype)


@lower(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float=False):
    if self.ndim == 0:
        return jnp.zeros_like(self)
    out = jax.nn.log_softmax(_f32(self), axis=norm_dim(dim, self.ndim))
    return out if half_to_float else out.astype(self.dtype)


@lower(aten._softmax_backward_data.default)
def softmax_backward(grad_output, output, dim, input_dtype):
    d = norm_dim(dim, output.ndim) if output.ndim else ()  # a 0-d softmax reduces over nothing
    g, y = _f32(grad_output), _f32(output)
    return (y * (g - jnp.sum(g * y, axis=d, keepdims=True))).astype(jdtype(input_dtype))


@lower(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad_output, output, dim, input_dtype):
    d = norm_dim(dim, output.ndim) if output.ndim else ()
    g, y = _f32(grad_output), _f32(output)
    return (g - jnp.exp(y) * jnp.sum(g, axis=d, keepdims=True)).astype(jdtype(input_dtype))
