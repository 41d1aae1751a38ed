"""Special functions: gamma family, orthogonal polynomials (Bessel functions: bessel.py).

Where `jax.scipy.special` has the function it is used as is. The orthogonal
polynomials follow PyTorch's kernels (aten/src/ATen/native/Math.h): the same
special cases and the same three-term recurrences, run as a `lax.while_loop` up to
the largest degree in `n` (degrees are data, so the loop count is too).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jss
import torch
from jax import lax

from ..core.registry import lower

aten = torch.ops.aten


def as_float(x):
    """An integer or bool input as float32, as torch.special promotes it (a float or complex one as it is)."""
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


# --- gamma family ------------------------------------------------------------------


def digamma(x):
    """digamma with PyTorch's values at the poles: -inf at +0, +inf at -0 (NaN below)."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jss.digamma(x))


_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)


def _hurwitz_zeta(x, q):
    """Cephes' zeta(x, q) as PyTorch computes it: a direct sum until q + i > 9, then
    Euler-Maclaurin. Unlike jax.scipy.special.zeta it is accurate for negative q."""
    eps = jnp.finfo(x.dtype).eps
    pole_q = (q <= 0) & (q == jnp.floor(q))
    bad_q = (q <= 0) & (x != jnp.floor(x))

    def cond(state):
        return jnp.any(~state[4])

    def body(state):
        i, a, b, s, done = state
        go = ~done
        a2 = jnp.where(go, a + 1, a)
        b2 = jnp.where(go, a2 ** -x, b)
        s2 = jnp.where(go, s + b2, s)
        conv = go & (jnp.abs(b2 / s2) < eps)
        i2 = i + 1
        done2 = done | ((i2 >= 9) & (a2 > 9)) | conv
        return i2, a2, b2, s2, done2

    s0 = q ** -x
    # Non-finite inputs would never leave the loop: they are settled after it.
    start_done = pole_q | bad_q | (x <= 1) | ~jnp.isfinite(q) | jnp.isnan(x)
    _, a, b, s, _ = lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), q, s0, s0, start_done))
    early = jnp.abs(b / s) < eps
    w = a
    tail = s + b * w / (x - 1) - 0.5 * b
    coef = jnp.ones_like(x)
    k = jnp.zeros_like(x)
    stop = early
    for A in _ZETA_A:
        coef = coef * (x + k)
        b = b / w
        t = coef * b / A
        tail = jnp.where(stop, tail, tail + t)
        stop = stop | (jnp.abs(t / tail) < eps)
        k = k + 1
        coef = coef * (x + k)
        b = b / w
        k = k + 1
    out = jnp.where(early, s, tail)
    out = jnp.where(x == 1, jnp.inf, out)
    out = jnp.where(x < 1, jnp.nan, out)
    out = jnp.where(pole_q & (x >= 1), jnp.inf, out)
    out = jnp.where(bad_q & ~pole_q & (x >= 1), jnp.nan, out)
    out = jnp.where(jnp.isnan(q) | jnp.isnan(x), jnp.nan, out)
    out = jnp.where(jnp.isinf(q) & (q > 0) & (x > 1), 0.0, out)
    return jnp.where(jnp.isinf(q) & (q < 0) & (x >= 1), jnp.nan, out)


def _trigamma(x):
    """PyTorch's trigamma: reflection below 1/2, six recurrence steps, asymptotic series."""
    neg = x < 0.5
    sin_pi_x = jnp.sin(jnp.pi * x)
    result = jnp.where(neg, -(jnp.pi * jnp.pi) / (sin_pi_x * sin_pi_x), 0)
    sign = jnp.where(neg, -1, 1).astype(x.dtype)
    x = jnp.where(neg, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1.0 / 6 - ixx * (1.0 / 30 - ixx * (1.0 / 42)))) / x
    return sign * result


@lower(aten.polygamma.default)
def polygamma(n, self):
    x = as_float(self)
    if n == 0:
        return digamma(x)
    if n == 1:
        return _trigamma(x)
    # psi^(n)(x) = (-1)^(n+1) n! zeta(n + 1, x)
    sign = 1.0 if n % 2 else -1.0
    factorial = float(math.factorial(n))
    return (sign * factorial * _hurwitz_zeta(jnp.full_like(x, n + 1), x)).astype(x.dtype)


@lower(aten.special_polygamma.default)
def special_polygamma(n, self):
    return polygamma(n, self)


@lower(aten.special_zeta)
def zeta(self, other):
    x, q = jnp.broadcast_arrays(as_float(self), as_float(other))
    dtype = jnp.result_type(x, q)
    return _hurwitz_zeta(x.astype(dtype), q.astype(dtype))


def _igamma_edges(out, a, x, complement):
    """PyTorch's special cases of the regularized incomplete gamma functions."""
    lo, hi = (1.0, 0.0) if complement else (0.0, 1.0)
    out = jnp.where(jnp.isinf(x), hi, out)
    out = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), jnp.nan, lo), out)
    out = jnp.where(x == 0, lo, out)
    out = jnp.where(a == 0, jnp.where(x > 0, hi, jnp.nan), out)
    return jnp.where((x < 0) | (a < 0), jnp.nan, out)


@lower(aten.igamma)
def igamma(self, other):
    a, x = jnp.broadcast_arrays(as_float(self), as_float(other))
    return _igamma_edges(jss.gammainc(a, x), a, x, complement=False)


@lower(aten.igammac)
def igammac(self, other):
    a, x = jnp.broadcast_arrays(as_float(self), as_float(other))
    return _igamma_edges(jss.gammaincc(a, x), a, x, complement=True)


@lower(aten.frexp.Tensor)
def frexp(self):
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(jnp.int32)


# --- orthogonal polynomials -------------------------------------------------------


def _recurrence(x, n, p0, p1, step):
    """p_k for k = n via p_{k+1} = step(k, x, p_k, p_{k-1}), elementwise, as a while loop."""
    n = jnp.broadcast_to(n, x.shape)
    top = jnp.max(n) if n.size else jnp.asarray(0, n.dtype)

    def cond(state):
        k, _, _ = state
        return k < top

    def body(state):
        k, p, q = state
        nxt = step(k.astype(x.dtype), x, p, q)
        # Each element stops at its own degree.
        active = k < n
        return k + 1, jnp.where(active, nxt, p), jnp.where(active, p, q)

    _, p, _ = lax.while_loop(cond, body, (jnp.ones((), n.dtype), p1, p0))
    return jnp.where(n == 0, p0, p)


def _poly_args(x, n):
    x, n = jnp.broadcast_arrays(as_float(x), jnp.asarray(n))
    if jnp.issubdtype(n.dtype, jnp.inexact):
        # PyTorch truncates a floating degree to an integer.
        n = n.astype(jnp.int64)
    return x, n.astype(jnp.int64)


def _chebyshev(kind, y, n, threshold):
    """Chebyshev polynomials of the four kinds at y, as PyTorch computes them: exact
    values at y = +-1, the trigonometric closed form for degrees above `threshold`
    inside (-1, 1), else the recurrence p_{k+1} = 2 y p_k - p_{k-1}."""
    first = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
    p = _recurrence(y, n, jnp.ones_like(y), first, lambda k, y, p, q: (y + y) * p - q)
    nf = n.astype(y.dtype)
    odd = n % 2 == 1
    theta = jnp.arccos(jnp.clip(y, -1, 1))
    if kind == "t":
        trig = jnp.cos(nf * theta)
        at_one, at_minus_one = jnp.ones_like(y), jnp.where(odd, -1.0, 1.0)
    elif kind == "u":
        s = jnp.sin(theta)
        trig = jnp.where(s != 0, jnp.sin((nf + 1) * theta) / jnp.where(s != 0, s, 1),
                         (nf + 1) * jnp.cos((nf + 1) * theta) / y)
        at_one, at_minus_one = nf + 1, jnp.where(odd, -(nf + 1), nf + 1)
    elif kind == "v":
        at_one, at_minus_one = jnp.ones_like(y), jnp.where(odd, -(nf + nf + 1), nf + nf + 1)
        trig = jnp.where(jnp.sin(theta / 2) != 1, jnp.cos((nf + 0.5) * theta) / jnp.cos(theta / 2), at_minus_one)
    else:
        at_one, at_minus_one = nf + nf + 1, jnp.where(odd, -1.0, 1.0)
        trig = jnp.where(jnp.cos(theta / 2) != 1, jnp.sin((nf + 0.5) * theta) / jnp.sin(theta / 2),
                         jnp.where(y > 0, at_one, at_minus_one))
    p = jnp.where((n > threshold) & (jnp.abs(y) < 1), trig, p)
    p = jnp.where(y == 1, at_one, jnp.where(y == -1, at_minus_one, p))
    return jnp.where(n < 0, 0, p).astype(y.dtype)


# PyTorch switches to the closed form above these degrees (Math.h).
_THRESHOLDS = {"t": 6, "u": 8, "v": 8, "w": 8}
_SHIFTED_THRESHOLDS = {"t": 6, "u": 6, "v": 6, "w": 4}


def _chebyshev_lowering(kind, shifted):
    def lowering(x, n):
        x, n = _poly_args(x, n)
        if shifted:
            return _chebyshev(kind, x + x - 1, n, _SHIFTED_THRESHOLDS[kind])
        return _chebyshev(kind, x, n, _THRESHOLDS[kind])

    return lowering


for _kind in "tuvw":
    lower(getattr(aten, f"special_chebyshev_polynomial_{_kind}"))(_chebyshev_lowering(_kind, False))
    lower(getattr(aten, f"special_shifted_chebyshev_polynomial_{_kind}"))(_chebyshev_lowering(_kind, True))


@lower(aten.special_hermite_polynomial_h)
def hermite_h(x, n):
    x, n = _poly_args(x, n)
    p = _recurrence(x, n, jnp.ones_like(x), x + x, lambda k, x, p, q: (x + x) * p - 2 * k * q)
    return jnp.where(n < 0, 0, p)


@lower(aten.special_hermite_polynomial_he)
def hermite_he(x, n):
    x, n = _poly_args(x, n)
    p = _recurrence(x, n, jnp.ones_like(x), x, lambda k, x, p, q: x * p - k * q)
    return jnp.where(n < 0, 0, p)


@lower(aten.special_laguerre_polynomial_l)
def laguerre_l(x, n):
    x, n = _poly_args(x, n)
    p = _recurrence(x, n, jnp.ones_like(x), 1 - x, lambda k, x, p, q: ((k + k + 1 - x) * p - k * q) / (k + 1))
    p = jnp.where(x == 0, 1.0, p)
    return jnp.where(n < 0, 0, p)


@lower(aten.special_legendre_polynomial_p)
def legendre_p(x, n):
    x, n = _poly_args(x, n)
    p = _recurrence(x, n, jnp.ones_like(x), x, lambda k, x, p, q: ((k + k + 1) * x * p - k * q) / (k + 1))
    odd = n % 2 == 1
    p = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | ~odd, 1.0, -1.0).astype(x.dtype), p)
    return jnp.where(n < 0, 0, p)
