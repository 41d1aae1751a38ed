"""FFTs: the three primitives PyTorch lowers every torch.fft function to.

`normalization` is PyTorch's fft_norm_mode: 0 = no scaling, 1 = 1/sqrt(n), 2 = 1/n,
with n the product of the transformed sizes (of the signal, for c2r). The JAX
transforms run unscaled (norm="backward" forward, norm="forward" inverse) and the
scale is applied once.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch

from ..core.registry import lower

aten = torch.ops.aten


def _scale(out, sizes, normalization):
    n = math.prod(sizes)
    if normalization == 0 or n == 0:
        return out
    factor = 1 / math.sqrt(n) if normalization == 1 else 1 / n
    return out * jnp.asarray(factor, jnp.finfo(out.dtype).dtype)


def _axes(x, dim):
    # The order of `dim` matters for r2c / c2r (the last one is halved), not for the sum.
    return [d % x.ndim for d in dim] if x.ndim else []


@lower(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    axes = _axes(self, dim)
    sizes = [self.shape[a] for a in axes]
    if onesided:
        out = jnp.fft.rfftn(self, axes=axes, norm="backward")
    else:
        out = jnp.fft.fftn(self, axes=axes, norm="backward")
    return _scale(out, sizes, normalization)


@lower(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    axes = _axes(self, dim)
    sizes = [self.shape[a] for a in axes]
    if forward:
        out = jnp.fft.fftn(self, axes=axes, norm="backward")
    else:
        out = jnp.fft.ifftn(self, axes=axes, norm="forward")
    return _scale(out, sizes, normalization)


@lower(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    axes = _axes(self, dim)
    sizes = [self.shape[a] for a in axes[:-1]] + [last_dim_size]
    # The input may hold more than last_dim_size // 2 + 1 bins: use only those.
    last = axes[-1]
    x = jnp.take(self, jnp.arange(last_dim_size // 2 + 1), axis=last) if self.shape[last] > last_dim_size // 2 + 1 else self
    out = jnp.fft.irfftn(x, s=sizes, axes=axes, norm="forward")
    return _scale(out, sizes, normalization)


@lower(aten._conj.default)
def conj_view(self):
    return jnp.conj(self)


