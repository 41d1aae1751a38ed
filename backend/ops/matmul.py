"""Matmuls: mm, bmm, matmul, the add* family, outer products, bilinear's _trilinear."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core import padding as pad_ops  # the PadOps action
from ..core.registry import lower

aten = torch.ops.aten


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


def _add_product(self, a, b, beta, alpha):
    """`beta * self + alpha * (a @ b)`. With bfloat16 or float16 operands the product stays float32 until the
    bias is added and the sum is rounded once, as PyTorch's CPU and CUDA kernels do (rounding the product
    first, then the sum, differed from them in a quarter of a bf16 Linear's outputs)."""
    low = a.dtype in (jnp.bfloat16, jnp.float16) and a.dtype == b.dtype == jnp.result_type(self)
    if not low:
        return _scaled(pad_ops.matmul(a, b), self, beta, alpha)
    out = _scaled(pad_ops.matmul(a, b, preferred_element_type=jnp.float32), jnp.asarray(self, jnp.float32), beta, alpha)
    return out.astype(a.dtype)


@lower(aten.addmm.default)
def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    return _add_product(self, mat1, mat2, beta, alpha)


@lower(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    return _add_product(self, batch1, batch2, beta, alpha)


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


# --- bilinear ---------------------------------------------------------------------------


@lower(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    def expand(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x

    prod = expand(i1, expand1) * expand(i2, expand2) * expand(i3, expand3)
    return jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod


@lower(aten.linear_backward.default)
def linear_backward(self, grad_output, weight, output_mask):
    g = grad_output.reshape(-1, grad_output.shape[-1])
    x = self.reshape(-1, self.shape[-1])
    grad_input = pad_ops.matmul(grad_output, weight) if output_mask[0] else None
    grad_weight = pad_ops.matmul(g.T, x) if output_mask[1] else None
    grad_bias = jnp.sum(g, axis=0) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias
