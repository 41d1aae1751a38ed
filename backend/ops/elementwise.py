"""Pointwise ops: arithmetic, comparisons, math functions, activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core.registry import lower

aten = torch.ops.aten


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_int(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


# --- unary maths -------------------------------------------------------------------

_UNARY = {
    aten.abs: jnp.abs,
    aten.neg: jnp.negative,
    aten.exp: jnp.exp,
    aten.exp2: jnp.exp2,
    aten.expm1: jnp.expm1,
    aten.log: jnp.log,
    aten.log2: jnp.log2,
    aten.log10: jnp.log10,
    aten.log1p: jnp.log1p,
    aten.sqrt: jnp.sqrt,
    aten.rsqrt: lax.rsqrt,
    aten.sin: jnp.sin,
    aten.cos: jnp.cos,
    aten.tan: jnp.tan,
    aten.asin: jnp.arcsin,
    aten.acos: jnp.arccos,
    aten.atan: jnp.arctan,
    aten.sinh: jnp.sinh,
    aten.cosh: jnp.cosh,
    aten.tanh: jnp.tanh,
    aten.asinh: jnp.arcsinh,
    aten.acosh: jnp.arccosh,
    aten.atanh: jnp.arctanh,
    aten.erf: jax.scipy.special.erf,
    aten.erfc: jax.scipy.special.erfc,
    aten.erfinv: jax.scipy.special.erfinv,
    aten.lgamma: jax.scipy.special.gammaln,
    # PyTorch's digamma is -inf at +0 and +inf at -0 (JAX gives NaN).
    aten.digamma: lambda x: jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jax.scipy.special.digamma(x)),
    aten.sigmoid: jax.nn.sigmoid,
    aten.sign: jnp.sign,
    aten.sgn: jnp.sign,
    aten.floor: jnp.floor,
    aten.ceil: jnp.ceil,
    aten.trunc: jnp.trunc,
    aten.frac: lambda x: x - jnp.trunc(x),
    aten.reciprocal: jnp.reciprocal,
    aten.square: jnp.square,
    aten.bitwise_not: lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.bitwise_not(x),
    aten.logical_not: jnp.logical_not,
    aten.isnan: jnp.isnan,
    aten.isinf: jnp.isinf,
    aten.isfinite: jnp.isfinite,
    aten.isposinf: jnp.isposinf,
    aten.isneginf: jnp.isneginf,
    aten.signbit: jnp.signbit,
    aten.i0: jax.scipy.special.i0,
    aten.special_i0e: jax.scipy.special.i0e,
    aten.special_i1: jax.scipy.special.i1,
    aten.special_i1e: jax.scipy.special.i1e,
    aten.special_erfcx: jax.scipy.special.erfcx if hasattr(jax.scipy.special, "erfcx") else None,
    aten.special_ndtri: jax.scipy.special.ndtri,
    aten.special_ndtr: jax.scipy.special.ndtr,
    aten.special_log_ndtr: jax.scipy.special.log_ndtr,
    aten.special_entr: jax.scipy.special.entr,
    aten.conj_physical: jnp.conj,
    aten._conj_physical: jnp.conj,
    aten.deg2rad: jnp.deg2rad,
    aten.rad2deg: jnp.rad2deg,
    aten.angle: jnp.angle,
    aten.positive: lambda x: x,
}


def _unary(fn):
    # Integer inputs of float functions promote in JAX too; the dispatcher casts the
    # result to the dtype PyTorch promises.
    def lowering(self):
        return fn(self)

    return lowering


for _op, _fn in _UNARY.items():
    if _fn is not None:
        lower(_op)(_unary(_fn))


@lower(aten.round.default)
def round_(self):
    return jnp.round(self)


@lower(aten.round.decimals)
def round_decimals(self, *, decimals=0):
    return jnp.round(self, decimals)


@lower(aten.logit)
def logit(self, eps=None):
    x = self if eps is None else jnp.clip(self, eps, 1 - eps)
    return jnp.log(x / (1 - x))


@lower(aten.nan_to_num)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    return jnp.nan_to_num(self, nan=0.0 if nan is None else nan, posinf=posinf, neginf=neginf)


# --- binary arithmetic -------------------------------------------------------------


def _alpha(other, alpha):
    return other if alpha is None or (not isinstance(alpha, jax.Array) and alpha == 1) else other * alpha


@lower(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=1):
    return jnp.add(self, _alpha(other, alpha))


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=1):
    return jnp.subtract(self, _alpha(other, alpha))


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=1):
    return jnp.subtract(other, _alpha(self, alpha))


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    if jnp.result_type(self) == jnp.bool_ and jnp.result_type(other) == jnp.bool_:
        return jnp.logical_and(self, other)
    return jnp.multiply(self, other)


@lower(aten.div.Tensor, aten.div.Scalar)
def div(self, other):
    return jnp.true_divide(self, other)


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(self, other, *, rounding_mode=None):
    if rounding_mode is None:
        return jnp.true_divide(self, other)
    if rounding_mode == "trunc":
        if _is_int(self) and _is_int(other):
            q = lax.div(*jnp.broadcast_arrays(*_same_type(self, other)))
            return q
        return jnp.trunc(jnp.true_divide(self, other))
    if _is_int(self) and _is_int(other):
        return jnp.floor_divide(self, other)
    return jnp.floor(jnp.true_divide(self, other))


def _same_type(a, b):
    t = jnp.result_type(a, b)
    return jnp.asarray(a, t), jnp.asarray(b, t)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(self, other):
    if _is_int(self) and _is_int(other):
        return jnp.floor_divide(self, other)
    return jnp.floor(jnp.true_divide(self, other))


@lower(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(self, other):
    return jnp.remainder(self, other)


@lower(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(self, other):
    return jnp.fmod(self, other)


@lower(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow_(self, exponent):
    if _is_int(self) and _is_int(exponent):
        return lax.integer_pow(self, int(exponent)) if isinstance(exponent, int) and exponent >= 0 else jnp.power(self, exponent)
    return jnp.power(self, exponent)


@lower(aten.atan2)
def atan2(self, other):
    return jnp.arctan2(self, other)


@lower(aten.hypot)
def hypot(self, other):
    return jnp.hypot(self, other)


@lower(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(self, other):
    return jnp.copysign(self, other)


@lower(aten.nextafter)
def nextafter(self, other):
    return jnp.nextafter(self, other)


@lower(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other)
def xlogy(self, other):
    return jax.scipy.special.xlogy(self, other)


@lower(aten.special_xlog1py)
def xlog1py(self, other):
    return jax.scipy.special.xlog1py(self, other)


@lower(aten.logaddexp)
def logaddexp(self, other):
    return jnp.logaddexp(self, other)


@lower(aten.logaddexp2)
def logaddexp2(self, other):
    return jnp.logaddexp2(self, other)


@lower(aten.maximum)
def maximum(self, other):
    return jnp.maximum(self, other)


@lower(aten.minimum)
def minimum(self, other):
    return jnp.minimum(self, other)


@lower(aten.fmax)
def fmax(self, other):
    return jnp.fmax(self, other)


@lower(aten.fmin)
def fmin(self, other):
    return jnp.fmin(self, other)


@lower(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    return self + weight * (end - self)


@lower(aten.addcmul)
def addcmul(self, tensor1, tensor2, *, value=1):
    return self + value * tensor1 * tensor2


@lower(aten.addcdiv)
def addcdiv(self, tensor1, tensor2, *, value=1):
    return self + value * (tensor1 / tensor2)


# --- comparisons and logic --------------------------------------------------------

for _op, _fn in {
    aten.eq: jnp.equal,
    aten.ne: jnp.not_equal,
    aten.lt: jnp.less,
    aten.le: jnp.less_equal,
    aten.gt: jnp.greater,
    aten.ge: jnp.greater_equal,
    aten.logical_and: jnp.logical_and,
    aten.logical_or: jnp.logical_or,
    aten.logical_xor: jnp.logical_xor,
}.items():
    lower(_op)(lambda self, other, _fn=_fn: _fn(self, other))


def _bitwise(int_fn, bool_fn):
    def lowering(self, other):
        if jnp.result_type(self) == jnp.bool_ and jnp.result_type(other) == jnp.bool_:
            return bool_fn(self, other)
        return int_fn(self, other)

    return lowering


lower(aten.bitwise_and)(_bitwise(jnp.bitwise_and, jnp.logical_and))
lower(aten.bitwise_or)(_bitwise(jnp.bitwise_or, jnp.logical_or))
lower(aten.bitwise_xor)(_bitwise(jnp.bitwise_xor, jnp.logical_xor))


@lower(aten.bitwise_left_shift)
def left_shift(self, other):
    return jnp.left_shift(self, other)


@lower(aten.bitwise_right_shift)
def right_shift(self, other):
    return jnp.right_shift(self, other)


@lower(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(condition, self, other):
    return jnp.where(condition, self, other)


@lower(aten.clamp.default, aten.clamp.Tensor)
def clamp(self, min=None, max=None):
    out = self
    if min is not None:
        out = jnp.maximum(out, jnp.asarray(min, dtype=jnp.result_type(out, min)))
    if max is not None:
        out = jnp.minimum(out, jnp.asarray(max, dtype=jnp.result_type(out, max)))
    return out


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):
    return jnp.maximum(self, min)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):
    return jnp.minimum(self, max)


@lower(aten.isclose)
def isclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return jnp.isclose(self, other, rtol=rtol, atol=atol, equal_nan=equal_nan)


@lower(aten.heaviside)
def heaviside(self, values):
    return jnp.heaviside(self, values)


# --- activations -------------------------------------------------------------------


@lower(aten.relu)
def relu(self):
    return jnp.maximum(self, jnp.zeros((), self.dtype))


def _in_float32(x):
    """bfloat16 and float16 computed in float32 and rounded once at the end, as PyTorch's kernels do for
    composite functions (gelu's erf and products rounded one by one in bfloat16 differed in half the outputs)."""
    return x.astype(jnp.float32) if x.dtype in (jnp.bfloat16, jnp.float16) else x


@lower(aten.gelu)
def gelu(self, *, approximate="none"):
    return jax.nn.gelu(_in_float32(self), approximate=approximate == "tanh").astype(self.dtype)


@lower(aten.gelu_backward)
def gelu_backward(grad_output, self, *, approximate="none"):
    _, vjp = jax.vjp(lambda x: jax.nn.gelu(x, approximate=approximate == "tanh"), _in_float32(self))
    return vjp(_in_float32(grad_output))[0].astype(grad_output.dtype)


@lower(aten.silu)
def silu(self):
    return jax.nn.silu(self)


@lower(aten.silu_backward)
def silu_backward(grad_output, self):
    s = jax.nn.sigmoid(self)
    return grad_output * s * (1 + self * (1 - s))


@lower(aten.threshold_backward)
def threshold_backward(grad_output, self, threshold):
    return jnp.where(self <= threshold, jnp.zeros((), grad_output.dtype), grad_output)


@lower(aten.threshold)
def threshold(self, threshold, value):
    return jnp.where(self <= threshold, value, self)


@lower(aten.sigmoid_backward)
def sigmoid_backward(grad_output, output):
    return grad_output * output * (1 - output)


@lower(aten.tanh_backward)
def tanh_backward(grad_output, output):
    return grad_output * (1 - output * output)


@lower(aten.leaky_relu)
def leaky_relu(self, negative_slope=0.01):
    return jnp.where(self > 0, self, self * negative_slope)


@lower(aten.elu)
def elu(self, alpha=1, scale=1, input_scale=1):
    return scale * jnp.where(self > 0, self, alpha * jnp.expm1(self * input_scale))


@lower(aten.softplus)
def softplus(self, beta=1, threshold=20):
    scaled = self * beta
    return jnp.where(scaled > threshold, self, jnp.log1p(jnp.exp(scaled)) / beta)


@lower(aten.hardtanh)
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.clip(self, min_val, max_val)


@lower(aten.hardsigmoid)
def hardsigmoid(self):
    return jnp.clip(self / 6 + 0.5, 0, 1)


@lower(aten.hardswish)
def hardswish(self):
    return self * jnp.clip(self / 6 + 0.5, 0, 1)


@lower(aten.mish)
def mish(self):
    return self * jnp.tanh(jax.nn.softplus(self))


@lower(aten.log_sigmoid_forward)
def log_sigmoid_forward(self):
    # The buffer is exp(-|x|), as PyTorch's CPU kernel keeps it for the backward.
    return jax.nn.log_sigmoid(self), jnp.exp(-jnp.abs(self))


@lower(aten.complex)
def complex_(real, imag):
    return lax.complex(*jnp.broadcast_arrays(real, imag))


@lower(aten.polar)
def polar(abs, angle):
    abs, angle = jnp.broadcast_arrays(abs, angle)
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))


@lower(aten.hardshrink_backward)
def hardshrink_backward(grad_out, self, lambd):
    # PyTorch's mask: the gradient is kept outside [-lambd, lambd], bounds excluded.
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_out.dtype), grad_out)


@lower(aten.softshrink_backward)
def softshrink_backward(grad_output, self, lambd):
    return jnp.where((self >= -lambd) & (self <= lambd), jnp.zeros((), grad_output.dtype), grad_output)
