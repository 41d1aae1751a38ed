"""Matmuls, convolution, pooling, normalisation, losses.

Backward ops whose formula is just the VJP of the forward are lowered as
`jax.vjp` of the forward lowering: one definition, no second formula to drift.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax._src.lax.windowed_reductions import _reduce_window_max  # differentiable, unlike a generic reduce

from .. import padding as pad_ops  # the PadOps action (the name `padding` is a conv argument here)
from ..registry import lower
from ._util import norm_dim

aten = torch.ops.aten


# --- matmul family -------------------------------------------------------------------


@lower(aten.mm.default)
def mm(self, mat2):
    return pad_ops.matmul(self, mat2)


@lower(aten.bmm.default)
def bmm(self, mat2):
    return pad_ops.matmul(self, mat2)


@lower(aten.matmul.default)
def matmul(self, other):
    return pad_ops.matmul(self, other)


@lower(aten.mv.default)
def mv(self, vec):
    return jnp.matmul(self, vec)


@lower(aten.dot.default, aten.vdot.default)
def dot(self, other):
    return jnp.dot(self, other)


def _scaled(out, base, beta, alpha):
    if not (not isinstance(alpha, jax.Array) and alpha == 1):
        out = out * alpha
    if not isinstance(beta, jax.Array) and beta == 0:
        return out
    if not (not isinstance(beta, jax.Array) and beta == 1):
        # beta == 0 ignores the input entirely (NaN and inf included), as in PyTorch.
        return jnp.where(beta == 0, out, out + base * beta)
    return out + base


@lower(aten.addmm.default)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _scaled(pad_ops.matmul(mat1, mat2), self, beta, alpha)


@lower(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled(pad_ops.matmul(batch1, batch2), self, beta, alpha)


@lower(aten.addmv.default)
def addmv(self, mat, vec, *, beta=1, alpha=1):
    return _scaled(jnp.matmul(mat, vec), self, beta, alpha)


@lower(aten.addbmm.default)
def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _scaled(jnp.sum(jnp.matmul(batch1, batch2), axis=0), self, beta, alpha)


@lower(aten.addr.default)
def addr(self, vec1, vec2, *, beta=1, alpha=1):
    return _scaled(jnp.outer(vec1, vec2), self, beta, alpha)


@lower(aten.outer.default)
def outer(self, vec2):
    return jnp.outer(self, vec2)


# --- convolution -----------------------------------------------------------------------


def _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = input.ndim - 2
    stride, padding, dilation = (tuple(v) * (nd if len(v) == 1 else 1) for v in (stride, padding, dilation))
    spatial = "DHW"[-nd:] if nd <= 3 else None
    dn = lax.conv_dimension_numbers(input.shape, weight.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
    if not transposed:
        def run(x, w):
            return lax.conv_general_dilated(
                x, w, window_strides=stride, padding=[(p, p) for p in padding],
                rhs_dilation=dilation, dimension_numbers=dn, feature_group_count=groups,
            )

        out = run(input, weight) if groups != 1 else pad_ops.conv(input, weight, run)
    else:
        output_padding = tuple(output_padding) * (nd if len(output_padding) == 1 else 1)
        # A transposed conv is the gradient of a conv: dilate the input, flip the kernel.
        cin = weight.shape[0] // groups
        w = weight.reshape((groups, cin, weight.shape[1]) + weight.shape[2:])
        w = jnp.swapaxes(w, 1, 2).reshape((groups * weight.shape[1], cin) + weight.shape[2:])
        w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
        pads = [
            (dilation[i] * (weight.shape[2 + i] - 1) - padding[i],
             dilation[i] * (weight.shape[2 + i] - 1) - padding[i] + output_padding[i])
            for i in range(nd)
        ]
        dn = lax.conv_dimension_numbers(input.shape, w.shape, ("NC" + spatial, "OI" + spatial, "NC" + spatial))
        out = lax.conv_general_dilated(
            input, w, window_strides=(1,) * nd, padding=pads, lhs_dilation=stride,
            rhs_dilation=dilation, dimension_numbers=dn, feature_group_count=groups,
        )
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd)
    return out


@lower(aten.convolution.default)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    batched = input.ndim == weight.ndim
    if not batched:
        input = input[None]
    out = _conv(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return out if batched else out[0]


@lower(aten.convolution_backward.default)
def convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    def f(x, w):
        return _conv(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(f, input, weight)
    grad_input, grad_weight = vjp(grad_output)
    grad_bias = jnp.sum(grad_output, axis=(0,) + tuple(range(2, grad_output.ndim))) if output_mask[2] else None
    return (grad_input if output_mask[0] else None, grad_weight if output_mask[1] else None, grad_bias)


# --- pooling ---------------------------------------------------------------------------


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
    values = _reduce_window_max(padded, window, strides, [(0, 0)] * self.ndim, window_dilation=dil)
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
    total = lax.reduce_window(self, jnp.asarray(0, self.dtype), lax.add, window, strides, full_pads)
    if divisor_override:
        return total / divisor_override
    if count_include_pad:
        # Padding counts, the overhang of ceil_mode does not.
        ones = jnp.ones(spatial, self.dtype)
        ones = jnp.pad(ones, [(p, p) for p in padding], constant_values=1)
        # Negative high padding trims the symmetric padding that no window reaches.
        ones = lax.pad(ones, jnp.asarray(0, self.dtype), [(0, hi - lo, 0) for (lo, hi) in pads])
        count = lax.reduce_window(ones, jnp.asarray(0, self.dtype), lax.add, kernel, stride, [(0, 0)] * nd)
    else:
        ones = jnp.ones(spatial, self.dtype)
        count = lax.reduce_window(ones, jnp.asarray(0, self.dtype), lax.add, kernel, stride, pads)
    return total / count


@lower(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2)


@lower(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2), self)
    return vjp(grad_output)[0]


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


# --- normalisation ---------------------------------------------------------------------


def _moments(x, axes, eps):
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return mean, lax.rsqrt(var + eps)


@lower(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    x = input.astype(jnp.float32) if input.dtype in (jnp.float16, jnp.bfloat16) else input
    mean, rstd = _moments(x, axes, eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out.astype(input.dtype), mean, rstd


@lower(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    lead = tuple(range(input.ndim - len(normalized_shape)))
    x_hat = (input - mean) * rstd
    g = grad_out * weight if weight is not None else grad_out
    grad_input = rstd * (
        g - jnp.mean(g, axis=axes, keepdims=True) - x_hat * jnp.mean(g * x_hat, axis=axes, keepdims=True)
    )
    grad_weight = jnp.sum(grad_out * x_hat, axis=lead) if output_mask[1] and weight is not None else None
    grad_bias = jnp.sum(grad_out, axis=lead) if output_mask[2] and bias is not None else None
    return (grad_input if output_mask[0] else None, grad_weight, grad_bias)


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    axes = (0,) + tuple(range(2, input.ndim))
    shape = (1, -1) + (1,) * (input.ndim - 2)
    x = input.astype(jnp.float32) if input.dtype in (jnp.float16, jnp.bfloat16) else input
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - mean.reshape(shape)), axis=axes)
        n = input.size // input.shape[1]
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
            new_var = (1 - momentum) * running_var + momentum * (var * n / max(n - 1, 1)).astype(running_var.dtype)
    else:
        mean, var = running_mean, running_var
        new_mean, new_var = running_mean, running_var
    rstd = lax.rsqrt(var + eps)
    out = (x - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    # In eval mode PyTorch's CPU kernel returns empty save_mean / save_rstd, but its meta
    # kernel (which the dispatcher checks results against) promises (C,): return the
    # statistics used, the running ones. The backward reads the running stats in eval.
    return out.astype(input.dtype), mean.astype(x.dtype), rstd.astype(x.dtype), new_mean, new_var


@lower(aten._native_batch_norm_legit_functional.default)
def native_batch_norm_legit_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lower(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, True, momentum, eps)[:3]


@lower(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@lower(aten.native_batch_norm.default)
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)[:3]


@lower(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
                               train, eps, output_mask):
    shape = (1, -1) + (1,) * (input.ndim - 2)
    axes = (0,) + tuple(range(2, input.ndim))

    def f(x, w):
        if train:
            mean = jnp.mean(x, axis=axes)
            rstd = lax.rsqrt(jnp.mean(jnp.square(x - mean.reshape(shape)), axis=axes) + eps)
        else:
            mean, rstd = running_mean, lax.rsqrt(running_var + eps)
        out = (x - mean.reshape(shape)) * rstd.reshape(shape)
        return out * w.reshape(shape) if w is not None else out

    ones = jnp.ones((input.shape[1],), input.dtype)
    _, vjp = jax.vjp(f, input, weight if weight is not None else ones)
    gi, gw = vjp(grad_out)
    gb = jnp.sum(grad_out, axis=axes) if output_mask[2] else None
    # As PyTorch's meta kernel: grad_input always, the others as output_mask asks.
    return gi, (gw if output_mask[1] else None), gb


@lower(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = input.reshape(N, group, -1)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    rstd = lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + eps)
    out = ((x - mean) * rstd).reshape(input.shape)
    shape = (1, -1) + (1,) * (input.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean.reshape(N, group), rstd.reshape(N, group)


# --- losses ------------------------------------------------------------------------------

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _nll(self, target, weight, reduction, ignore_index):
    batched = self.ndim >= 2
    logp = self if batched else self[None]
    tgt = target if batched else target[None]
    logp = jnp.moveaxis(logp, 1, -1)  # (N, ..., C)
    valid = tgt != ignore_index
    safe = jnp.where(valid, tgt, 0)
    picked = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    w = weight[safe] if weight is not None else jnp.ones_like(picked)
    w = jnp.where(valid, w, 0)
    losses = picked * w
    if reduction == 0:
        return losses if batched else losses[0], jnp.zeros((), self.dtype)
    total_weight = jnp.sum(w)
    total = jnp.sum(losses)
    return (total / total_weight if reduction == 1 else total), total_weight


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll(self, target, weight, reduction, ignore_index)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    _, vjp = jax.vjp(lambda x: _nll(x, target, weight, reduction, ignore_index)[0], self)
    return vjp(grad_output)[0]


@lower(aten.mse_loss.default)
def mse_loss(self, target, reduction=1):
    out = jnp.square(self - target)
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


@lower(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    scale = 2.0 / self.size if reduction == 1 else 2.0
    return grad_output * scale * (self - target)


@lower(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    log_p = jnp.maximum(jnp.log(self), -100)
    log_1p = jnp.maximum(jnp.log1p(-self), -100)
    out = -(target * log_p + (1 - target) * log_1p)
    if weight is not None:
        out = out * weight
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


@lower(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x: binary_cross_entropy(x, target, weight, reduction), self)
    return vjp(grad_output)[0]


@lower(aten.huber_loss.default)
def huber_loss(self, target, reduction=1, delta=1.0):
    d = jnp.abs(self - target)
    out = jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


@lower(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    d = jnp.abs(self - target)
    out = jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta) if not (not isinstance(beta, jax.Array) and beta == 0) else d
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


del norm_dim


# --- more pooling: 3-d average, adaptive max / 3-d average ---------------------------------


@lower(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3)


@lower(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    _, vjp = jax.vjp(lambda x: _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 3), self)
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


# --- distances, bilinear, embedding bags -------------------------------------------------


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


@lower(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    def expand(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x

    prod = expand(i1, expand1) * expand(i2, expand2) * expand(i3, expand3)
    return jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod


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


# --- fractional max pooling ----------------------------------------------------------------


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


# --- grid sampling ---------------------------------------------------------------------------


def _grid_source_index(coords, size, padding_mode, align_corners):
    """Grid coordinates in [-1, 1] to input positions, with padding_mode 0 zeros, 1 border, 2 reflection."""
    mul = (size * 0.5 - 0.5) if align_corners else (size * 0.5)
    x = coords * mul + (size * 0.5 - 0.5)
    if padding_mode == 0:
        return x
    if padding_mode == 2:
        low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        span = high - low
        if span <= 0:
            x = jnp.zeros_like(x)
        else:
            d = jnp.abs(x - low)
            extra = jnp.fmod(d, span)
            flips = jnp.floor(d / span).astype(jnp.int64)
            x = jnp.where(flips % 2 == 0, extra + low, span + low - extra)
    return jnp.clip(x, 0, size - 1)


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    """Sample input (N, C, *spatial) at grid (N, *out, nd) (last coordinate = first spatial
    dim reversed: x is width). Bilinear / trilinear (mode 0) or nearest (mode 1)."""
    n, c = input.shape[:2]
    spatial = input.shape[2:]
    nd = len(spatial)
    out_shape = grid.shape[1:-1]
    pos = [_grid_source_index(grid[..., nd - 1 - d], spatial[d], padding_mode, align_corners) for d in range(nd)]
    flat_input = input.reshape(n, c, -1)

    def gather(idx):  # idx: per-dim integer positions (N, *out); out of bounds reads as 0
        ok = jnp.ones(idx[0].shape, bool)
        flat = jnp.zeros(idx[0].shape, jnp.int64)
        for d in range(nd):
            ok = ok & (idx[d] >= 0) & (idx[d] < spatial[d])
            flat = flat * spatial[d] + jnp.clip(idx[d], 0, spatial[d] - 1)
        flat = jnp.broadcast_to(flat.reshape(n, 1, -1), (n, c, flat[0].size))
        vals = jnp.take_along_axis(flat_input, flat, axis=-1).reshape((n, c) + out_shape)
        return jnp.where(ok[:, None], vals, 0)

    if interpolation_mode == 1:
        return gather([jnp.round(p).astype(jnp.int64) for p in pos])
    if interpolation_mode != 0:
        raise NotImplementedError(f"grid_sampler with interpolation_mode={interpolation_mode} and {nd} spatial dims")
    lo = [jnp.floor(p) for p in pos]
    out = jnp.zeros((n, c) + out_shape, input.dtype)
    for corner in np.ndindex(*(2,) * nd):
        idx, w = [], jnp.ones(grid.shape[:-1], input.dtype)
        for d, bit in enumerate(corner):
            w = w * ((pos[d] - lo[d]) if bit else (lo[d] + 1 - pos[d]))
            idx.append((lo[d] + bit).astype(jnp.int64))
        out = out + gather(idx) * w[:, None]
    return out


@lower(aten.grid_sampler_3d.default)
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


# --- antialiased resampling ------------------------------------------------------------------


def _aa_linear(x):
    return np.maximum(0.0, 1.0 - np.abs(x))


def _aa_cubic(x, a=-0.5):
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _aa_weights(in_size, out_size, align_corners, scale, filter_fn, interp_size):
    """PyTorch's antialiasing interpolation weights (UpSampleKernel.cpp), one row per output
    position: a triangle / cubic filter widened by the downscale factor, normalized."""
    f32 = np.float32
    if align_corners:
        s = f32((in_size - 1) / (out_size - 1)) if out_size > 1 else f32(0)
    else:
        s = f32(1.0 / scale) if scale is not None and scale > 0 else f32(in_size / out_size)
    support = f32(interp_size * 0.5) * s if s >= 1 else f32(interp_size * 0.5)
    invscale = f32(1.0) / s if s >= 1 else f32(1.0)
    w = np.zeros((out_size, in_size), np.float32)
    for i in range(out_size):
        center = s * f32(i + 0.5)
        lo = max(int(center - support + f32(0.5)), 0)
        hi = min(int(center + support + f32(0.5)), in_size)
        j = np.arange(lo, hi)
        row = filter_fn((j - center + f32(0.5)).astype(f32) * invscale).astype(f32)
        total = row.sum(dtype=f32)
        w[i, lo:hi] = row / total if total != 0 else row
    return w


def _upsample_aa(self, output_size, align_corners, scales, filter_fn, interp_size):
    h, w = self.shape[-2:]
    oh, ow = output_size
    wh = _aa_weights(h, oh, align_corners, scales[0], filter_fn, interp_size)
    ww = _aa_weights(w, ow, align_corners, scales[1], filter_fn, interp_size)
    x = self.astype(jnp.float32) if self.dtype in (jnp.float16, jnp.bfloat16) else self
    out = jnp.einsum("oh,...hw,pw->...op", jnp.asarray(wh, x.dtype), x, jnp.asarray(ww, x.dtype),
                     precision=lax.Precision.HIGHEST)
    return out.astype(self.dtype)


def _aa_size(input, output_size, scale_factors):
    if output_size is not None:
        return tuple(output_size), (None, None)
    h, w = input.shape[-2:]
    return (int(h * scale_factors[0]), int(w * scale_factors[1])), tuple(scale_factors)


@lower(aten._upsample_bilinear2d_aa.default, static_floats=True)
def upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(self, output_size, align_corners, (scales_h, scales_w), _aa_linear, 2)


@lower(aten._upsample_bilinear2d_aa.vec, static_floats=True)
def upsample_bilinear2d_aa_vec(input, output_size, align_corners, scale_factors):
    size, scales = _aa_size(input, output_size, scale_factors)
    return _upsample_aa(input, size, align_corners, scales, _aa_linear, 2)


@lower(aten._upsample_bicubic2d_aa.default, static_floats=True)
def upsample_bicubic2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(self, output_size, align_corners, (scales_h, scales_w), _aa_cubic, 4)


@lower(aten._upsample_bicubic2d_aa.vec, static_floats=True)
def upsample_bicubic2d_aa_vec(input, output_size, align_corners, scale_factors):
    size, scales = _aa_size(input, output_size, scale_factors)
    return _upsample_aa(input, size, align_corners, scales, _aa_cubic, 4)


# --- CTC loss --------------------------------------------------------------------------------


def _ctc(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    """CTC negative log likelihood by the forward (alpha) recursion in log space, over the
    extended label sequence blank, l1, blank, l2, ..., blank. Returns (nll, log_alpha)."""
    if log_probs.ndim == 2:  # unbatched (T, C)
        nll, alpha = _ctc(log_probs[:, None], targets.reshape(1, -1), list(input_lengths),
                          list(target_lengths), blank, zero_infinity)
        return nll[0], alpha[0]
    t_max, n, _ = log_probs.shape
    # The lengths are Python lists here: the widest label sequence sets log_alpha's size.
    s_max = max(target_lengths, default=0)
    input_lengths = jnp.asarray(input_lengths, jnp.int64).reshape(n)
    target_lengths = jnp.asarray(target_lengths, jnp.int64).reshape(n)
    if targets.ndim == 1:  # concatenated targets: gather each sequence from its offset
        offsets = jnp.cumsum(target_lengths) - target_lengths
        idx = jnp.clip(offsets[:, None] + jnp.arange(s_max), 0, max(targets.shape[0] - 1, 0))
        labels = targets[idx] if targets.shape[0] else jnp.zeros((n, 0), jnp.int64)
    else:
        labels = targets[:, :s_max]
    length = 2 * s_max + 1
    s = jnp.arange(length)
    ext = jnp.where(s % 2 == 0, blank, labels[:, jnp.clip((s - 1) // 2, 0, max(s_max - 1, 0))] if s_max else blank)
    ext = ext.astype(jnp.int64)
    valid = s[None, :] < 2 * target_lengths[:, None] + 1
    prev2 = jnp.concatenate([ext[:, :2], ext[:, :-2]], axis=1) if length > 2 else ext
    skip = (s % 2 == 1)[None, :] & (s >= 2)[None, :] & (ext != prev2)
    lp = jnp.take_along_axis(log_probs, jnp.broadcast_to(ext[None], (t_max, n, length)), axis=2)  # (T, N, L)
    neg = jnp.asarray(-jnp.inf, log_probs.dtype)
    init = jnp.where((s == 0)[None, :] | ((s == 1)[None, :] & (target_lengths[:, None] > 0)), lp[0], neg)
    init = jnp.where(valid, init, neg)

    def step(alpha, inputs):
        t, lp_t = inputs
        a1 = jnp.concatenate([jnp.full((n, 1), neg), alpha[:, :-1]], axis=1)
        a2 = jnp.concatenate([jnp.full((n, 2), neg), alpha[:, :-2]], axis=1)[:, :length]
        new = jnp.logaddexp(jnp.logaddexp(alpha, a1), jnp.where(skip, a2, neg)) + lp_t
        new = jnp.where(valid, new, neg)
        live = (t < input_lengths)[:, None]
        return jnp.where(live, new, alpha), jnp.where(live, new, neg)

    final, rest = lax.scan(step, init, (jnp.arange(1, t_max), lp[1:]))
    log_alpha = jnp.concatenate([jnp.where((input_lengths > 0)[:, None], init, neg)[None], rest], axis=0)
    last = jnp.take_along_axis(final, (2 * target_lengths)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(final, jnp.maximum(2 * target_lengths - 1, 0)[:, None], axis=1)[:, 0]
    nll = -jnp.logaddexp(last, jnp.where(target_lengths > 0, before, neg))
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    return nll, jnp.transpose(log_alpha, (1, 0, 2))


@lower(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return _ctc(log_probs, targets, list(input_lengths), list(target_lengths), blank, zero_infinity)


@lower(aten._ctc_loss.Tensor, jit=False)
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # As PyTorch does, read the lengths to the host: log_alpha's size depends on them.
    return _ctc(log_probs, targets, [int(v) for v in np.asarray(input_lengths).reshape(-1)],
                [int(v) for v in np.asarray(target_lengths).reshape(-1)], blank, zero_infinity)
