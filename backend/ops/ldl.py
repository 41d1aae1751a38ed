"""Symmetric indefinite factorization and solve (torch.linalg.ldl_factor_ex, ldl_solve): Bunch-Kaufman LDL^T
with LAPACK's pivot encoding, written as LAPACK's sytf2 / sytrs (lower)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core.registry import lower
from .linalg import mT, real_dtype, zero_info

aten = torch.ops.aten


# --- symmetric indefinite (Bunch-Kaufman LDL^T), as LAPACK's sytf2 / sytrs (lower) ------------

_BK_ALPHA = (1.0 + 17.0**0.5) / 8.0


def _cabs1(x):
    # LAPACK's pivot size for complex entries: |re| + |im|.
    return jnp.abs(x.real) + jnp.abs(x.imag) if jnp.iscomplexobj(x) else jnp.abs(x)


def _ldl_factor_one(a):
    """LAPACK dsytf2 (uplo='L') on one matrix: returns LD (lower), 1-based pivots (negative
    for 2x2 blocks) and info. The trailing block is kept as a full symmetric matrix."""
    n = a.shape[-1]
    idx = jnp.arange(n)
    a = jnp.tril(a) + mT(jnp.tril(a, -1))
    alpha = jnp.asarray(_BK_ALPHA, real_dtype(a.dtype))

    def body(state):
        k, a, piv, info = state
        col = _cabs1(a[:, k])
        below = idx > k
        absakk = col[k]
        colmax = jnp.max(jnp.where(below, col, 0))
        imax = jnp.argmax(jnp.where(below, col, -1))
        row = _cabs1(a[imax])
        rowmax = jnp.max(jnp.where((idx >= k) & (idx != imax), row, 0))
        zero = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        keep = absakk >= alpha * colmax
        keep2 = absakk >= alpha * colmax * (colmax / rowmax)
        take_imax = _cabs1(a[imax, imax]) >= alpha * rowmax
        kstep = jnp.where(zero | keep | keep2 | take_imax, 1, 2)
        kp = jnp.where(zero | keep | keep2, k, imax).astype(jnp.int32)
        kk = k + kstep - 1
        # Interchange rows and columns kk and kp of the trailing block A[k:, k:].
        perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
        swapped = a[perm][:, perm]
        block = (idx[:, None] >= k) & (idx[None, :] >= k)
        a = jnp.where(block & ~zero, swapped, a)
        # kstep 1: A22 -= x x^T / d, then x /= d.
        d11 = 1 / a[k, k]
        x = jnp.where(below, a[:, k], 0)
        rest = below[:, None] & below[None, :]
        one = jnp.where(rest, a + x[:, None] * (-d11 * x)[None, :], a)
        one = one.at[:, k].set(jnp.where(below, a[:, k] * d11, a[:, k]))
        # kstep 2: eliminate with the 2x2 pivot block D = A[k:k+2, k:k+2].
        k1 = jnp.minimum(k + 1, n - 1)
        d21 = a[k1, k]
        e11 = a[k1, k1] / d21
        e22 = a[k, k] / d21
        t = 1 / (e11 * e22 - 1)
        f21 = t / d21
        below2 = idx > k + 1
        ca, cb = jnp.where(below2, a[:, k], 0), jnp.where(below2, a[:, k1], 0)
        wk = f21 * (e11 * ca - cb)
        wkp1 = f21 * (e22 * cb - ca)
        rest2 = below2[:, None] & below2[None, :]
        two = jnp.where(rest2, a - ca[:, None] * wk[None, :] - cb[:, None] * wkp1[None, :], a)
        two = two.at[:, k].set(jnp.where(below2, wk, a[:, k])).at[:, k1].set(jnp.where(below2, wkp1, a[:, k1]))
        new = jnp.where(zero, a, jnp.where(kstep == 1, one, two))
        piv = jnp.where(kstep == 1, piv.at[k].set(kp + 1), piv.at[k].set(-(kp + 1)).at[k1].set(-(kp + 1)))
        info = jnp.where(zero & (info == 0), k + 1, info).astype(jnp.int32)
        return k + kstep, new, piv, info

    state = (jnp.asarray(0, jnp.int32), a, jnp.zeros((n,), jnp.int32), jnp.asarray(0, jnp.int32))
    _, a, piv, info = lax.while_loop(lambda s: s[0] < n, body, state)
    return jnp.tril(a), piv.astype(jnp.int32), info.astype(jnp.int32)


def _ldl_solve_one(ld, piv, b):
    """LAPACK dsytrs (uplo='L'): solve A X = B from A's Bunch-Kaufman factors."""
    n = ld.shape[-1]
    idx = jnp.arange(n)

    def swap(b, i, j):
        perm = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
        return b[perm]

    def forward(state):  # L D Y = B
        k, b = state
        p = piv[k]
        one = p > 0
        k1 = jnp.minimum(k + 1, n - 1)
        b = jnp.where(one, swap(b, k, p - 1), swap(b, k1, -p - 1))
        below = (idx > k)[:, None]
        b1 = jnp.where(below, b - ld[:, k][:, None] * b[k][None, :], b)
        b1 = b1.at[k].set(b1[k] / ld[k, k])
        below2 = (idx > k + 1)[:, None]
        b2 = jnp.where(below2, b - ld[:, k][:, None] * b[k][None, :], b)
        b2 = jnp.where(below2, b2 - ld[:, k1][:, None] * b[k1][None, :], b2)
        akm1k = ld[k1, k]
        akm1 = ld[k, k] / akm1k
        ak = ld[k1, k1] / akm1k
        denom = akm1 * ak - 1
        bkm1, bk = b2[k] / akm1k, b2[k1] / akm1k
        b2 = b2.at[k].set((ak * bkm1 - bk) / denom).at[k1].set((akm1 * bk - bkm1) / denom)
        return k + jnp.where(one, 1, 2), jnp.where(one, b1, b2)

    def backward(state):  # L^T X = Y
        k, b = state
        p = piv[k]
        one = p > 0
        below = (idx > k)[:, None]
        rows = jnp.where(below, b, 0)
        b = b.at[k].add(-jnp.sum(ld[:, k][:, None] * rows, axis=0))
        km1 = jnp.maximum(k - 1, 0)
        b = jnp.where(one, b, b.at[km1].add(-jnp.sum(ld[:, km1][:, None] * rows, axis=0)))
        b = swap(b, k, jnp.abs(p) - 1)
        return k - jnp.where(one, 1, 2), b

    _, b = lax.while_loop(lambda s: s[0] < n, forward, (jnp.asarray(0), b))
    _, b = lax.while_loop(lambda s: s[0] >= 0, backward, (jnp.asarray(n - 1), b))
    return b


def _batched(fn, *args, core_dims):
    """vmap `fn` over the (broadcast) leading dims of args with the given core ranks."""
    batch = jnp.broadcast_shapes(*(a.shape[: a.ndim - c] for a, c in zip(args, core_dims)))
    flat = [jnp.broadcast_to(a, batch + a.shape[a.ndim - c:]).reshape((-1,) + a.shape[a.ndim - c:])
            for a, c in zip(args, core_dims)]
    out = jax.vmap(fn)(*flat)
    return jax.tree_util.tree_map(lambda o: o.reshape(batch + o.shape[1:]), out)


@lower(aten.linalg_ldl_factor_ex.default)
def linalg_ldl_factor_ex(self, *, hermitian=False, check_errors=False):
    if jnp.iscomplexobj(self) and hermitian:
        raise NotImplementedError("linalg.ldl_factor with hermitian=True on complex input")
    if self.size == 0:
        return self, jnp.zeros(self.shape[:-1], jnp.int32), zero_info(self)
    return _batched(_ldl_factor_one, self, core_dims=(2,))


@lower(aten.linalg_ldl_solve.default)
def linalg_ldl_solve(LD, pivots, B, *, hermitian=False):
    if jnp.iscomplexobj(LD) and hermitian:
        raise NotImplementedError("linalg.ldl_solve with hermitian=True on complex input")
    if LD.shape[-1] == 0:
        batch = jnp.broadcast_shapes(LD.shape[:-2], B.shape[:-2])
        return jnp.broadcast_to(B, batch + B.shape[-2:])
    return _batched(_ldl_solve_one, LD, pivots, B, core_dims=(2, 1, 2))
