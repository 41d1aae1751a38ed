"""Pooling: max (with indices), average, adaptive max / average, fractional max; 2-d and 3-d.

Backward ops whose formula is just the VJP of the forward are lowered as
`jax.vjp` of the forward lowering: one definition, no second formula to drift.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..core.registry import lower

aten = torch.ops.aten


# --- shared: window arguments, output sizes -------------------------------------------


def _pool_args(kernel_size, stride, padding, dilation, nd):
    expand = lambda v, default: tuple(v) * (nd if len(v) == 1 else 1) if v else default  # noqa: E731
    kernel = expand(kernel_size, None)
    return kernel, expand(stride, kernel), expand(padding, (0,) * nd), expand(dilation, (1,) * nd)


def _pool_out_size(n, k, s, p, d, ceil_mode):
    span = n + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


# --- max pooling -----------------------------------------------------------------------


def _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, nd):
    kernel, stride, padding, dilation = _pool_args(kernel_size, stride, padding, dilation, nd)
    spatial = self.shape[-nd:]
    pads = []
    for i in range(nd):
        out = _pool_out_size(spatial[i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode)
        needed = (out - 1) * stride[i] + dilation[i] * (kernel[i] - 1) + 1
        pads.append((padding[i], max(needed - spatial[i] - padding[i], 0)))
    lead = self.ndim - nd
    init = -jnp.inf if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype).min
    # Values and flat spatial indices reduced together, so the argmax is exact.
    flat_idx = jnp.arange(int(np.prod(spatial)), dtype=jnp.int64).reshape(spatial)
    flat_idx = jnp.broadcast_to(flat_idx, self.shape)
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    dil = (1,) * lead + dilation
    full_pads = [(0, 0)] * lead + pads

    def select(a, b):
        va, ia = a
        vb, ib = b
        take_b = (vb > va) | jnp.isnan(vb) | ((vb == va) & (ib < ia))
        take_b = take_b & ~jnp.isnan(va)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    # Indices from a variadic reduction (not differentiable, so on a stopped gradient);
    # values from a plain max, which JAX differentiates (a compiled module's backward is a VJP).
    _, indices = lax.reduce_window(
        (lax.stop_gradient(self), flat_idx), (jnp.asarray(init, self.dtype), jnp.asarray(-1, jnp.int64)),
        select, window, strides, full_pads, window_dilation=dil,
    )
    padded = lax.pad(self, jnp.asarray(init, self.dtype), [(lo, hi, 0) for lo, hi in full_pads])
    # A max whose init is its identity as a concrete (numpy) value is lax's differentiable
    # max window reduction; a traced init would make it a generic, undifferentiable reduce.
    values = lax.reduce_window(padded, np.asarray(init, self.dtype), lax.max, window, strides,
                               [(0, 0)] * self.ndim, window_dilation=dil)
    return values, indices


@lower(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 2)


@lower(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool(self, kernel_size, stride, padding, dilation, ceil_mode, 3)


def _max_pool_backward(grad_output, self, indices, nd):
    spatial = self.shape[-nd:]
    lead = self.shape[:-nd]
    n = int(np.prod(spatial))
    g = grad_output.reshape(lead + (-1,))
    idx = indices.reshape(lead + (-1,))
    out = jnp.zeros(lead + (n,), grad_output.dtype)
    batch = tuple(jnp.arange(s).reshape((-1,) + (1,) * (len(lead) - i)) for i, s in enumerate(lead))
    out = out.at[batch + (idx,)].add(g)
    return out.reshape(self.shape)


@lower(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


# --- average pooling -------------------------------------------------------------------


def _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, nd):
    kernel, stride, padding, _ = _pool_args(kernel_size, stride, padding, (1,), nd)
    spatial = self.shape[-nd:]
    lead = self.ndim - nd
    pads = []
    for i in range(nd):
        out = _pool_out_size(spatial[i], kernel[i], stride[i], padding[i], 1, ceil_mode)
        needed = (out - 1) * stride[i] + kernel[i]
        pads.append((padding[i], max(needed - spatial[i] - padding[i], 0)))
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    full_pads = [(0, 0)] * lead + pads
    # Concrete (numpy) zeros as init make these lax's differentiable sum window reductions.
    total = lax.reduce_window(self, np.zeros((), self.dtype), lax.add, window, strides, full_pads)
    if divisor_override:
        return total / divisor_override
    if count_include_pad:
        # Padding counts, the overhang of ceil_mode does not.
        ones = jnp.ones(spatial, self.dtype)
        ones = jnp.pad(ones, [(p, p) for p in padding], constant_values=1)
        # Negative high padding trims the symmetric padding that no window reaches.
        ones = lax.pad(ones, jnp.asarray(0, self.dtype), [(0, hi - lo, 0) for (lo, hi) in pads])
        count = lax.reduce_window(ones, np.zeros((), self.dtype), lax.add, kernel, stride, [(0, 0)] * nd)
    else:
        ones = jnp.ones(spatial, self.dtype)
        count = lax.reduce_window(ones, np.zeros((), self.dtype), lax.add, kernel, stride, pads)
    return total / count


@lower(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@lower(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2), self)
    return vjp(grad_output)[0]


@lower(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


@lower(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3), self)
    return vjp(grad_output)[0]


# --- adaptive pooling ------------------------------------------------------------------


@lower(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(self, output_size):
    h, w = self.shape[-2:]
    oh, ow = output_size
    if h % oh == 0 and w % ow == 0:
        shape = self.shape[:-2] + (oh, h // oh, ow, w // ow)
        return jnp.mean(self.reshape(shape), axis=(-3, -1))
    rows = [(int(np.floor(i * h / oh)), int(np.ceil((i + 1) * h / oh))) for i in range(oh)]
    cols = [(int(np.floor(j * w / ow)), int(np.ceil((j + 1) * w / ow))) for j in range(ow)]
    out = [[jnp.mean(self[..., r0:r1, c0:c1], axis=(-2, -1)) for (c0, c1) in cols] for (r0, r1) in rows]
    return jnp.stack([jnp.stack(r, axis=-1) for r in out], axis=-2)


@lower(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad_output, self):
    _, vjp = jax.vjp(lambda x: adaptive_avg_pool2d(x, grad_output.shape[-2:]), self)
    return vjp(grad_output)[0]


def _adaptive_windows(n, o):
    """Per output position: the input positions of its window (padded) and which are real."""
    starts = np.array([(i * n) // o for i in range(o)])
    ends = np.array([-(-((i + 1) * n) // o) for i in range(o)])
    k = int((ends - starts).max()) if o else 0
    pos = starts[:, None] + np.arange(k)[None, :]
    return np.minimum(pos, n - 1), pos < ends[:, None]


def _adaptive_gather(self, output_size):
    """Windows of adaptive pooling over the last len(output_size) dims: the gathered values
    with the window positions moved last and flattened, the validity mask, the flat indices."""
    nd = len(output_size)
    spatial = self.shape[-nd:]
    lead = self.ndim - nd
    x = self
    valid = np.ones((), bool)
    flat = np.zeros((), np.int64)
    for i, (n, o) in enumerate(zip(spatial, output_size)):
        pos, ok = _adaptive_windows(n, o)
        axis = lead + 2 * i
        x = jnp.take(x, jnp.asarray(pos.reshape(-1)), axis=axis).reshape(x.shape[:axis] + pos.shape + x.shape[axis + 1:])
        valid = valid[..., None, None] & ok
        flat = flat[..., None, None] * n + pos
    # (..., o1, k1, o2, k2, ...) -> (..., o1, o2, ..., k1 * k2 * ...)
    outs = [lead + 2 * i for i in range(nd)]
    ks = [lead + 2 * i + 1 for i in range(nd)]
    x = jnp.transpose(x, tuple(range(lead)) + tuple(outs) + tuple(ks))
    x = x.reshape(x.shape[: lead + nd] + (int(np.prod(x.shape[lead + nd:])),))
    perm = tuple(range(0, 2 * nd, 2)) + tuple(range(1, 2 * nd, 2))
    valid = valid.transpose(perm).reshape(tuple(output_size) + (-1,))
    flat = flat.transpose(perm).reshape(tuple(output_size) + (-1,))
    return x, jnp.asarray(valid), jnp.asarray(flat)


def _adaptive_max_pool(self, output_size):
    x, valid, flat = _adaptive_gather(self, output_size)
    low = -jnp.inf if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype).min
    x = jnp.where(valid, x, low)
    pick = jnp.argmax(x, axis=-1)[..., None]
    values = jnp.take_along_axis(x, pick, axis=-1)[..., 0]
    indices = jnp.take_along_axis(jnp.broadcast_to(flat, x.shape), pick, axis=-1)[..., 0]
    return values, indices.astype(jnp.int64)


@lower(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(self, output_size):
    return _adaptive_max_pool(self, tuple(output_size))


@lower(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@lower(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return _max_pool_backward(grad_output, self, indices, 3)


@lower(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(self, output_size):
    x, valid, _ = _adaptive_gather(self, tuple(output_size))
    total = jnp.sum(jnp.where(valid, x, 0), axis=-1)
    return (total / jnp.sum(valid, axis=-1).astype(total.dtype)).astype(self.dtype)


@lower(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad_output, self):
    _, vjp = jax.vjp(lambda x: adaptive_avg_pool3d(x, grad_output.shape[-3:]), self)
    return vjp(grad_output)[0]


# --- fractional max pooling ------------------------------------------------------------


def _fractional_starts(sample, n, o, k):
    """PyTorch's generate_intervals, per plane: window starts from a U(0, 1) sample,
    computed in the sample's precision; the last window ends at the input's end."""
    if o <= 1:
        return jnp.full(sample.shape + (o,), n - k, jnp.int64)
    alpha = jnp.asarray((n - k), sample.dtype) / jnp.asarray(o - 1, sample.dtype)
    i = jnp.arange(o - 1, dtype=sample.dtype)
    s = sample[..., None]
    starts = ((i + s) * alpha).astype(jnp.int64) - (s * alpha).astype(jnp.int64)
    return jnp.concatenate([starts, jnp.full(sample.shape + (1,), n - k, jnp.int64)], axis=-1)


def _fractional_max_pool(self, kernel_size, output_size, random_samples, order):
    """Max over windows at pseudo-random starts. `order[d]` is the column of random_samples
    that drives spatial dim d. Returns values and flat spatial indices (first max wins)."""
    nd = len(kernel_size)
    batched = self.ndim == nd + 2
    x = self if batched else self[None]
    n, c = x.shape[:2]
    random_samples = random_samples[:n]  # PyTorch reads plane b's samples by batch index: an unbatched input, the first
    spatial = x.shape[2:]
    flat = jnp.zeros((n, c), jnp.int64)
    valid_shape = (n, c)
    for d in range(nd):
        starts = _fractional_starts(random_samples[..., order[d]], spatial[d], output_size[d], kernel_size[d])
        pos = starts[..., :, None] + jnp.arange(kernel_size[d])  # (n, c, o_d, k_d)
        # Grow the flat index by one (o_d, k_d) pair of axes per dim.
        flat = flat[..., None, None] * spatial[d] + pos.reshape((n, c) + (1, 1) * d + pos.shape[2:])
        valid_shape = valid_shape + pos.shape[2:]
    outs = tuple(2 + 2 * d for d in range(nd))
    ks = tuple(3 + 2 * d for d in range(nd))
    flat = jnp.transpose(flat, (0, 1) + outs + ks).reshape((n, c) + tuple(output_size) + (-1,))
    values = jnp.take_along_axis(x.reshape(n, c, -1), flat.reshape(n, c, -1), axis=-1).reshape(flat.shape)
    pick = jnp.argmax(values, axis=-1)[..., None]
    out = jnp.take_along_axis(values, pick, axis=-1)[..., 0]
    idx = jnp.take_along_axis(flat, pick, axis=-1)[..., 0]
    return (out, idx) if batched else (out[0], idx[0])


@lower(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    # random_samples[..., 0] drives the width, [..., 1] the height.
    return _fractional_max_pool(self, tuple(kernel_size), tuple(output_size), random_samples, (1, 0))


@lower(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, tuple(kernel_size), tuple(output_size), random_samples, (0, 1, 2))


@lower(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 2)


@lower(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return _max_pool_backward(grad_output, self, indices, 3)
