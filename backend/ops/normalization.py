"""Normalisation: layer norm, batch norm (training, eval, functional), group norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core.registry import lower

aten = torch.ops.aten


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
    # bfloat16 and float16 in float32, each gradient rounded once at the end, as PyTorch's kernels do.
    up = (lambda a: a.astype(jnp.float32) if a.dtype in (jnp.float16, jnp.bfloat16) else a)
    dy = up(grad_out)
    x_hat = (up(input) - mean) * rstd
    g = dy * up(weight) if weight is not None else dy
    grad_input = rstd * (
        g - jnp.mean(g, axis=axes, keepdims=True) - x_hat * jnp.mean(g * x_hat, axis=axes, keepdims=True)
    )
    grad_weight = jnp.sum(dy * x_hat, axis=lead).astype(weight.dtype) if output_mask[1] and weight is not None else None
    grad_bias = jnp.sum(dy, axis=lead).astype(bias.dtype) if output_mask[2] and bias is not None else None
    return (grad_input.astype(input.dtype) if output_mask[0] else None, grad_weight, grad_bias)


def _running(running, momentum, value):
    """The running statistic's next value, as PyTorch's kernels compute it: momentum * value + (1 - momentum) *
    running (momentum=None's cumulative average reaches the op as momentum 1 / num_batches_tracked)."""
    return momentum * value.astype(running.dtype) + (1 - momentum) * running


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(output, save_mean, save_rstd, new running_mean, new running_var): the new running statistics are None
    where there are none to update (eval, or no running statistics)."""
    axes = (0,) + tuple(range(2, input.ndim))
    shape = (1, -1) + (1,) * (input.ndim - 2)
    x = input.astype(jnp.float32) if input.dtype in (jnp.float16, jnp.bfloat16) else input
    if training:
        mean = jnp.mean(x, axis=axes)
        var = jnp.mean(jnp.square(x - mean.reshape(shape)), axis=axes)
        new_mean = new_var = None
        if running_mean is not None:
            new_mean = _running(running_mean, momentum, mean)
        if running_var is not None:  # the unbiased variance, n / (n - 1) (n = 1: inf or nan, as on the CPU)
            n = input.size // input.shape[1]
            new_var = _running(running_var, momentum, var * n / jnp.asarray(n - 1, var.dtype))
    else:
        mean, var = running_mean, running_var
        new_mean = new_var = None
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
    out, save_mean, save_rstd, new_mean, new_var = _batch_norm(input, weight, bias, running_mean, running_var,
                                                               training, momentum, eps)
    # This schema returns the running statistics whatever `training` says: unchanged in eval.
    return (out, save_mean, save_rstd, running_mean if new_mean is None else new_mean,
            running_var if new_var is None else new_var)


@lower(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, True, momentum, eps)[:3]


@lower(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@lower(aten.native_batch_norm.default)
def native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    # Its schema does not mark running_mean / running_var as written, but PyTorch's kernels update them in
    # training: the new values follow the three results (opinfo.UNDECLARED_WRITES), and dispatch writes them.
    return _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)


def _channel_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    x = x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x
    mean = jnp.mean(x, axis=axes)
    return x, mean, jnp.mean(jnp.square(x - mean.reshape(shape)), axis=axes), axes, shape


@lower(aten.batch_norm_update_stats.default)
def batch_norm_update_stats(input, running_mean, running_var, momentum):
    """(mean, biased variance) over every dim but 1; running_mean / running_var updated (unbiased variance)."""
    _, mean, var, _, _ = _channel_stats(input)
    n = input.size // input.shape[1]
    new_mean = None if running_mean is None else _running(running_mean, momentum, mean)
    new_var = None if running_var is None else _running(running_var, momentum, var * n / jnp.asarray(n - 1, var.dtype))
    return mean.astype(input.dtype), var.astype(input.dtype), new_mean, new_var


# SyncBatchNorm's ops (PyTorch has them for CUDA only): local statistics, their combination over the
# gathered ranks' (with the running statistics' update), the normalisation, and the backward's two halves.

@lower(aten.batch_norm_stats.default)
def batch_norm_stats(input, eps):
    _, mean, var, _, _ = _channel_stats(input)
    return mean, lax.rsqrt(var + eps)


def _gather_stats(mean, invstd, running_mean, running_var, momentum, eps, counts):
    """Every rank's (count, mean, variance) combined, as CUDA's kernel does (its Welford merge, in closed form)."""
    counts = counts.astype(mean.dtype).reshape(-1, 1)
    var = (1 / jnp.square(invstd) - eps)  # each rank's biased variance
    n = jnp.sum(counts, axis=0)
    avg = jnp.sum(counts * mean, axis=0) / n
    var_n = jnp.sum(counts * (var + jnp.square(mean - avg)), axis=0)
    new_mean = None if running_mean is None else _running(running_mean, momentum, avg)
    new_var = None if running_var is None else _running(running_var, momentum, var_n / (n - 1))
    return avg, lax.rsqrt(var_n / n + eps), new_mean, new_var


@lower(aten.batch_norm_gather_stats_with_counts.default)
def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    return _gather_stats(mean, invstd, running_mean, running_var, momentum, eps, counts)


@lower(aten.batch_norm_gather_stats.default)
def batch_norm_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, count):
    counts = jnp.full((mean.shape[0],), count, mean.dtype)
    return _gather_stats(mean, invstd, running_mean, running_var, momentum, eps, counts)


@lower(aten.batch_norm_elemt.default)
def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    shape = (1, -1) + (1,) * (input.ndim - 2)
    x = input.astype(mean.dtype) if input.dtype in (jnp.float16, jnp.bfloat16) else input
    out = (x - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.astype(input.dtype)


@lower(aten.batch_norm_backward_reduce.default)
def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    """(sum_dy, sum_dy_xmu, grad_weight, grad_bias) per channel, each as its flag asks."""
    axes = (0,) + tuple(range(2, input.ndim))
    shape = (1, -1) + (1,) * (input.ndim - 2)
    dy = grad_out.astype(mean.dtype)
    sum_dy = jnp.sum(dy, axis=axes)
    sum_dy_xmu = jnp.sum(dy * (input.astype(mean.dtype) - mean.reshape(shape)), axis=axes)
    param = weight.dtype if weight is not None else mean.dtype
    return (sum_dy if input_g else None, sum_dy_xmu if input_g else None,
            (sum_dy_xmu * invstd).astype(param) if weight_g else None, sum_dy.astype(param) if bias_g else None)


@lower(aten.batch_norm_backward_elemt.default)
def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    shape = (1, -1) + (1,) * (input.ndim - 2)
    n = jnp.sum(count).astype(mean.dtype)
    grad_mean = (sum_dy / n).reshape(shape)
    proj = (sum_dy_xmu / n * invstd * invstd).reshape(shape)
    scale = (invstd * weight.astype(mean.dtype) if weight is not None else invstd).reshape(shape)
    x = input.astype(mean.dtype)
    dy = grad_out.astype(mean.dtype)
    return ((dy - grad_mean - (x - mean.reshape(shape)) * proj) * scale).astype(input.dtype)


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

    # A bf16/fp16 input with float32 parameters (autocast) computes in float32, as the forward.
    x = input.astype(jnp.float32) if input.dtype in (jnp.float16, jnp.bfloat16) else input
    w = weight if weight is not None else jnp.ones((input.shape[1],), x.dtype)
    out, vjp = jax.vjp(f, x, w)
    gi, gw = vjp(grad_out.astype(out.dtype))
    param_dtype = weight.dtype if weight is not None else input.dtype
    gb = jnp.sum(grad_out.astype(out.dtype), axis=axes).astype(param_dtype) if output_mask[2] else None
    # As PyTorch's meta kernel: grad_input always, the others as output_mask asks.
    return gi.astype(input.dtype), (gw.astype(param_dtype) if output_mask[1] else None), gb


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



def _weight_norm(v, g, dim):
    """w = v * g / ||v||, the norm over every dim but `dim`, as PyTorch's decomposition of
    _weight_norm_interface (which lowers the forward)."""
    axes = tuple(d for d in range(v.ndim) if d != dim)
    norm = jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32) if g.dtype == jnp.bfloat16 else v),
                            axis=axes, keepdims=True))
    return v * (g / norm.astype(g.dtype))


@lower(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    _, vjp = jax.vjp(lambda v, g: _weight_norm(v, g, dim), saved_v, saved_g)
    return vjp(grad_w)
