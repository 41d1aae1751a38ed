"""Convolution (plain, grouped, transposed) and its backward, as the VJP of the forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core import padding as pad_ops  # the PadOps action (the name `padding` is a conv argument here)
from ..core.registry import lower

aten = torch.ops.aten


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
