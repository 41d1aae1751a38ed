"""Normalisation: layer norm, batch norm (training, eval, functional), group norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..registry import lower

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
