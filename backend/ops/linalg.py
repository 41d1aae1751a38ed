"""Linear algebra: factorizations, solves, decompositions (torch.linalg and friends; LDL^T: ldl.py).

PyTorch's conventions are kept where they differ from JAX's: LU pivots are 1-based
int32 (LAPACK's `ipiv`), `info` tensors are int32 zeros of the batch shape (the
factorizations here do not report failures; NaNs propagate instead), and outputs a
variant does not compute are empty tensors of shape (0,).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import torch
from jax import lax
from jax._src.lax import linalg as _lax_linalg  # geqrf is not re-exported by jax.lax.linalg

from ..core.registry import lower

aten = torch.ops.aten


def mT(x):
    """The matrix transpose of the last two dims (torch's `.mT`)."""
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(mT(x)) if jnp.iscomplexobj(x) else mT(x)


def zero_info(a):
    """A factorization's `info` that reports no failure: int32 zeros of the batch shape."""
    return jnp.zeros(a.shape[:-2], jnp.int32)


def _lu_info(lu):
    """LAPACK getrf's info: the 1-based index of the first zero pivot of U, else 0."""
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    if diag.shape[-1] == 0:
        return jnp.zeros(diag.shape[:-1], jnp.int32)
    zero = diag == 0
    return jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)


def _empty(dtype):
    return jnp.zeros((0,), dtype)


def real_dtype(dtype):
    """A complex dtype's real counterpart (a real dtype as it is)."""
    return jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


def _broadcast_batch(a, b):
    """Broadcast the batch dims (all but the last two) of two matrices."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _is_vector_rhs(a, b):
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


def _lu(a):
    """LU with partial pivoting: (LU, 1-based int32 pivots, 0-based row permutation)."""
    lu, pivots, perm = lax.linalg.lu(a)
    return lu, pivots.astype(jnp.int32) + 1, perm


def _pivots_to_perm(pivots, m):
    """LAPACK 1-based row interchanges to a permutation `perm`: A[perm] = L @ U."""
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


def _perm_matrix(perm, dtype):
    """P with A = P @ L @ U when A[perm] = L @ U."""
    m = perm.shape[-1]
    return mT(jax.nn.one_hot(perm, m, dtype=dtype))


def _unpack_lu(lu):
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower_ = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    return lower_, upper


def _tri_solve(a, b, *, lower, left=True, transpose=False, unit=False):
    """Solve op(A) X = B (left) or X op(A) = B with triangular A, batch dims broadcast."""
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(
        a, b, left_side=left, lower=lower, transpose_a=transpose, conjugate_a=transpose, unit_diagonal=unit
    )


def _solve_lu(lu, perm, b, *, adjoint=False):
    """Solve A X = B (or A^H X = B) from A's LU factors; b is (..., n, k)."""
    lower_, upper = jnp.tril(lu, -1) + jnp.eye(lu.shape[-1], dtype=lu.dtype), jnp.triu(lu)
    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    perm = jnp.broadcast_to(perm, batch + perm.shape[-1:])
    if not adjoint:
        pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        y = _tri_solve(lower_, pb, lower=True, unit=True)
        return _tri_solve(upper, y, lower=False)
    # A = P L U  =>  A^H X = B  <=>  U^H L^H P^T X = B.
    y = _tri_solve(upper, b, lower=False, transpose=True)
    z = _tri_solve(lower_, y, lower=True, transpose=True, unit=True)
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inv[..., :, None], axis=-2)


# --- decompositions ----------------------------------------------------------------


@lower(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        s = jnp.linalg.svd(A, compute_uv=False)
        return _empty(A.dtype), s, _empty(A.dtype)
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@lower(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        return _empty(A.dtype), jnp.linalg.qr(A, mode="r")
    q, r = jnp.linalg.qr(A, mode="complete" if mode == "complete" else "reduced")
    return q, r


@lower(aten.geqrf.default)
def geqrf(self):
    return _lax_linalg.geqrf(self)


@lower(aten.linalg_householder_product.default)
def householder_product(input, tau):
    return lax.linalg.householder_product(input, tau)


@lower(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    m = self.shape[-2]
    k = input2.shape[-1]
    # The full m x m Q: pad the reflectors with zero columns (tau 0 = identity).
    pad = [(0, 0)] * (self.ndim - 1) + [(0, m - self.shape[-1])]
    a = jnp.pad(self, pad) if m > self.shape[-1] else self[..., :m]
    tau = jnp.pad(input2, [(0, 0)] * (input2.ndim - 1) + [(0, m - k)])
    q = lax.linalg.householder_product(a, tau)
    if transpose:
        q = _mH(q)
    q, c = _broadcast_batch(q, input3)
    return jnp.matmul(q, c) if left else jnp.matmul(c, q)


@lower(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return (w, v) if compute_v else (w, _empty(A.dtype))


@lower(aten.linalg_eig.default)
def linalg_eig(self):
    w, v = jnp.linalg.eig(self)
    return w, v


@lower(aten.linalg_eigvals.default)
def linalg_eigvals(self):
    return jnp.linalg.eigvals(self)


def _cholesky_lower(a, upper):
    # LAPACK reads one triangle: the upper one of A is the lower one of A^H.
    return jnp.linalg.cholesky(_mH(a) if upper else a, symmetrize_input=False)


@lower(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, *, upper=False, check_errors=False):
    L = _cholesky_lower(self, upper)
    # A failed factorization comes back as NaNs: report the first failing minor (1-based).
    bad = jnp.isnan(jnp.diagonal(L, axis1=-2, axis2=-1))
    if bad.shape[-1] == 0:
        return (_mH(L) if upper else L), zero_info(self)
    info = jnp.where(jnp.any(bad, axis=-1), jnp.argmax(bad, axis=-1) + 1, 0).astype(jnp.int32)
    return (_mH(L) if upper else L), info


def cholesky(self, upper=False):
    L = _cholesky_lower(self, upper)
    return _mH(L) if upper else L


if hasattr(aten, "cholesky"):  # torch.cholesky's op: PyTorch 2.14 removed it (torch.linalg.cholesky stays)
    lower(aten.cholesky.default)(cholesky)


@lower(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper=False):
    # A = L L^H (or U^H U): solve L Y = B, then L^H X = Y.
    L = _mH(input2) if upper else input2
    y = _tri_solve(L, self, lower=True)
    return _tri_solve(L, y, lower=True, transpose=True)


@lower(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    eye = jnp.broadcast_to(jnp.eye(self.shape[-1], dtype=self.dtype), self.shape)
    return cholesky_solve(eye, self, upper)


@lower(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, *, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg.lu_factor with pivot=False")
    lu, pivots, _ = _lu(A)
    return lu, pivots, _lu_info(lu)


@lower(aten.linalg_lu.default)
def linalg_lu(A, *, pivot=True):
    if not pivot:
        raise NotImplementedError("linalg.lu with pivot=False")
    lu, _, perm = _lu(A)
    lower_, upper = _unpack_lu(lu)
    return _perm_matrix(perm, A.dtype), lower_, upper


@lower(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m = LU_data.shape[-2]
    if unpack_data:
        lower_, upper = _unpack_lu(LU_data)
    else:
        lower_ = upper = _empty(LU_data.dtype)
    if unpack_pivots:
        p = _perm_matrix(_pivots_to_perm(LU_pivots, m), LU_data.dtype)
    else:
        p = _empty(LU_data.dtype)
    return p, lower_, upper


@lower(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False):
    perm = _pivots_to_perm(pivots, LU.shape[-1])
    if left:
        return _solve_lu(LU, perm, B, adjoint=adjoint)
    # X A = B  <=>  A^H X^H = B^H   (X op(A) = B with op = adjoint: op(A)^H X^H = B^H).
    return _mH(_solve_lu(LU, perm, _mH(B), adjoint=not adjoint))


# --- solves and inverses ------------------------------------------------------------


@lower(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, *, check_errors=False):
    lu, _, perm = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _solve_lu(lu, perm, eye), _lu_info(lu)


@lower(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, *, left=True, check_errors=False):
    lu, pivots, perm = _lu(A)
    vector = _is_vector_rhs(A, B)
    b = B[..., None] if vector else B
    # X A = B  <=>  A^H X^H = B^H.
    x = _solve_lu(lu, perm, b) if left else _mH(_solve_lu(lu, perm, _mH(b), adjoint=True))
    return (x[..., 0] if vector else x), lu, pivots, _lu_info(lu)


@lower(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, *, upper, left=True, unitriangular=False):
    return _tri_solve(self, B, lower=not upper, left=left, unit=unitriangular)


@lower(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    x = _tri_solve(A, self, lower=not upper, transpose=transpose, unit=unitriangular)
    batch = x.shape[:-2]
    return x, jnp.broadcast_to(A, batch + A.shape[-2:])


def _det_lu(A):
    """The LU factors that det and slogdet return for their backward. Like PyTorch's CPU kernel
    for a contiguous real A (every tpu tensor reports contiguous strides), they factor A^T, and
    the backward solves with them accordingly; complex A is factored as is."""
    return _lu(A if jnp.iscomplexobj(A) else mT(A))


@lower(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, pivots, perm = _det_lu(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    n = A.shape[-1]
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype)
    if jnp.iscomplexobj(A):
        sign = parity * jnp.prod(diag / jnp.abs(diag), axis=-1)
    else:
        sign = parity * jnp.prod(jnp.sign(diag), axis=-1)
    logabsdet = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return sign, logabsdet, lu, pivots


@lower(aten._linalg_det.default)
def linalg_det(A):
    lu, pivots, _ = _det_lu(A)
    n = A.shape[-1]
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(A.dtype)
    det = parity * jnp.prod(jnp.diagonal(lu, axis1=-2, axis2=-1), axis=-1)
    return det, lu, pivots


def _rank_tol(s, m, n, atol, rtol):
    """PyTorch's pinv / matrix_rank threshold: max(atol, rtol * s_max)."""
    eps = jnp.finfo(s.dtype).eps
    smax = jnp.max(s, axis=-1, keepdims=True) if s.shape[-1] else jnp.zeros(s.shape[:-1] + (1,), s.dtype)
    if atol is None and rtol is None:
        rtol = eps * max(m, n)
    elif rtol is None:
        # An explicit atol > 0 with no rtol means rtol = 0.
        rtol = jnp.where(jnp.asarray(atol) > 0, 0.0, eps * max(m, n))
    atol = 0.0 if atol is None else atol
    atol = jnp.asarray(atol, s.dtype)
    rtol = jnp.asarray(rtol, s.dtype)
    if atol.ndim:
        atol = atol[..., None]
    if rtol.ndim:
        rtol = rtol[..., None]
    return jnp.maximum(atol, rtol * smax)


def _pinv(self, atol, rtol, hermitian):
    m, n = self.shape[-2:]
    if hermitian:
        w, v = jnp.linalg.eigh(self, symmetrize_input=False)
        tol = _rank_tol(jnp.abs(w), m, n, atol, rtol)
        winv = jnp.where(jnp.abs(w) > tol, 1 / jnp.where(w == 0, 1, w), 0).astype(v.dtype)
        return jnp.matmul(v * winv[..., None, :], _mH(v))
    u, s, vh = jnp.linalg.svd(self, full_matrices=False)
    tol = _rank_tol(s, m, n, atol, rtol)
    sinv = jnp.where(s > tol, 1 / jnp.where(s == 0, 1, s), 0).astype(u.dtype)
    return jnp.matmul(_mH(vh) * sinv[..., None, :], _mH(u))


@lower(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.atol_rtol_float)
def linalg_pinv(self, *, atol=None, rtol=None, hermitian=False):
    return _pinv(self, atol, rtol, hermitian)


@lower(aten.linalg_pinv.default, aten.linalg_pinv.rcond_tensor)
def linalg_pinv_rcond(self, rcond, hermitian=False):
    return _pinv(self, 0.0, rcond, hermitian)


@lower(aten.linalg_lstsq.default, jit=False)
def linalg_lstsq(self, b, rcond=None, *, driver=None):
    """Least squares via the SVD; which extra outputs are filled follows PyTorch's CPU drivers."""
    driver = driver or "gelsy"
    m, n = self.shape[-2:]
    vector = b.ndim == self.ndim - 1
    bb = b[..., None] if vector else b
    a, bb = _broadcast_batch(self, bb)
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    eps = jnp.finfo(s.dtype).eps
    rc = eps * max(m, n) if rcond is None or rcond < 0 else rcond
    smax = jnp.max(s, axis=-1, keepdims=True) if s.shape[-1] else jnp.zeros(s.shape[:-1] + (1,), s.dtype)
    keep = s > rc * smax
    sinv = jnp.where(keep, 1 / jnp.where(s == 0, 1, s), 0).astype(u.dtype)
    x = jnp.matmul(_mH(vh) * sinv[..., None, :], jnp.matmul(_mH(u), bb))
    rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
    real = real_dtype(self.dtype)
    residuals = _empty(real)
    if driver != "gelsy" and m > n and bool(jnp.all(rank == n)):
        residuals = jnp.sum(jnp.abs(bb - jnp.matmul(a, x)) ** 2, axis=-2)
        if vector:
            residuals = residuals[..., 0]
    if driver == "gels":
        rank = _empty(jnp.int64)
    sv = s if driver in ("gelsd", "gelss") else _empty(real)
    return (x[..., 0] if vector else x), residuals, rank, sv


@lower(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    return jsl.expm(self)



@lower(aten._linalg_check_errors.default, jit=False)
def linalg_check_errors(info, api_name, *, is_matrix):
    """Raise PyTorch's own error for a nonzero `info` (this reads `info` back to the host)."""
    host = np.asarray(info)
    if host.any():
        torch.ops.aten._linalg_check_errors(torch.from_numpy(host.copy()), api_name, is_matrix=is_matrix)
    return ()
