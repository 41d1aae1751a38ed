"""`prims.*` ops, which PyTorch's reference implementations (torch._refs, some decompositions
and Python kernels) call directly: each elementwise prim runs its aten twin's lowering.

Prims do no type promotion (their callers have converted the operands), so the aten
lowerings, which promote, compute the same result.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
import torch._prims  # noqa: F401  (defines the prims namespace)
from jax import lax

from ..core.registry import LOWERINGS, lower
from ._util import jdtype, norm_dims

aten = torch.ops.aten
prims = torch.ops.prims

# prim name -> the aten op whose lowering computes it (the same name unless given here).
_ELEMENTWISE = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "digamma", "erf", "erfc",
    "exp", "exp2", "expm1", "floor", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
    "rsqrt", "sign", "signbit", "sin", "sinh", "sqrt", "tan", "tanh", "trunc", "isfinite", "bitwise_not",
    "conj_physical", "add", "sub", "mul", "pow", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "eq", "ne",
    "lt", "le", "gt", "ge", "fmod", "remainder", "maximum", "minimum", "fmax", "fmin", "hypot", "nextafter", "gcd",
    "igamma", "igammac", "erf_inv", "ndtri", "erfcx", "bessel_i0", "bessel_i0e", "bessel_i1", "bessel_i1e",
    "bessel_j0", "bessel_j1", "spherical_bessel_j0", "zeta", "shift_left", "shift_right_arithmetic",
)
_ATEN_NAME = {
    "erf_inv": "erfinv", "ndtri": "special_ndtri", "erfcx": "special_erfcx", "bessel_i0": "i0",
    "bessel_i0e": "special_i0e", "bessel_i1": "special_i1", "bessel_i1e": "special_i1e",
    "bessel_j0": "special_bessel_j0", "bessel_j1": "special_bessel_j1",
    "spherical_bessel_j0": "special_spherical_bessel_j0", "zeta": "special_zeta",
    "shift_left": "bitwise_left_shift", "shift_right_arithmetic": "bitwise_right_shift",
}


def _twin(name):
    """The lowering of the aten op taking tensors where the prim does."""
    packet = getattr(aten, _ATEN_NAME.get(name, name))
    for overload in ("Tensor", "Tensor_Tensor", "default"):
        if overload in packet.overloads() and getattr(packet, overload) in LOWERINGS:
            return LOWERINGS[getattr(packet, overload)]
    return None


def _register_twins() -> None:
    for name in _ELEMENTWISE:
        entry = _twin(name)
        prim = getattr(prims, name).default
        if entry is not None and prim not in LOWERINGS:
            LOWERINGS[prim] = entry


_register_twins()


@lower(prims.div.default)
def div(self, other):
    # True division for floats, C's truncating division for integers.
    if jnp.issubdtype(self.dtype, jnp.integer) and jnp.issubdtype(other.dtype, jnp.integer):
        return lax.div(*jnp.broadcast_arrays(self, other))
    return jnp.true_divide(self, other)


@lower(prims.where.default)
def where(pred, a, b):
    return jnp.where(pred, a, b)


@lower(prims.convert_element_type.default)
def convert_element_type(a, dtype):
    return a.astype(jdtype(dtype))


def _reduction(reduce):
    def lowering(inp, dims, *, output_dtype=None):
        out = reduce(inp, axis=norm_dims(dims, inp.ndim) if dims is not None else None)
        return out.astype(jdtype(output_dtype, out.dtype))

    return lowering


for _name, _reduce in (("sum", jnp.sum), ("prod", jnp.prod), ("amax", jnp.max), ("amin", jnp.min)):
    lower(getattr(prims, _name).default)(_reduction(_reduce))
