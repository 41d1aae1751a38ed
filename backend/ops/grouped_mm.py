"""`aten._grouped_mm`: the grouped matmul of mixture-of-experts layers.

`offs` holds cumulative group ends (int32). Layouts, as PyTorch's:
  2d x 3d  (M, K) x (G, K, N) -> (M, N): rows of group g use weight g (the MoE forward);
  2d x 2d  (M, K) x (K, N)    -> (G, M, N): K is split into groups (the weight gradient);
  3d x 2d  (G, M, K) x (K, N) -> (M, N): columns of group g use matrix g;
  3d x 3d  (G, M, K) x (G, K, N) -> (G, M, N): a plain batched matmul, no offsets.
Rows (2d x 3d) or columns (3d x 2d) past the last offset are left uninitialized by
PyTorch; here they are zeros. Products accumulate in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core.registry import lower
from ._util import jdtype

aten = torch.ops.aten


def _group_sizes(offs):
    offs = offs.astype(jnp.int32)
    return jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))


# Ragged contraction (2d x 2d): JAX has no VJP for it, so it gets one from two ragged_dots.
_RAGGED_K = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [0]), ([], [])), lhs_ragged_dimensions=[1], rhs_group_dimensions=[],
)


@jax.custom_vjp
def _ragged_contract(a, b, sizes):
    return lax.ragged_dot_general(a, b, sizes, _RAGGED_K, preferred_element_type=jnp.float32)


def _ragged_contract_fwd(a, b, sizes):
    return _ragged_contract(a, b, sizes), (a, b, sizes)


def _ragged_contract_bwd(res, g):
    a, b, sizes = res
    # out[g] = a[:, K_g] @ b[K_g]: for k in group g, da[:, k] = dout[g] @ b[k] and db[k] = a[:, k] @ dout[g].
    da = lax.ragged_dot(b, jnp.swapaxes(g, 1, 2).astype(b.dtype), sizes, preferred_element_type=jnp.float32)
    db = lax.ragged_dot(a.T, g.astype(a.dtype), sizes, preferred_element_type=jnp.float32)
    return da.T.astype(a.dtype), db.astype(b.dtype), None


_ragged_contract.defvjp(_ragged_contract_fwd, _ragged_contract_bwd)


def _check(ok, message):
    if not ok:
        raise RuntimeError(message)


def _validate(mat_a, mat_b, offs, bias, out_dtype):
    """PyTorch's CPU kernel's checks (the meta kernel, which would make them, is not consulted)."""
    floats = (jnp.float32, jnp.bfloat16, jnp.float16)
    _check(mat_a.dtype in floats and mat_b.dtype in floats,
           "_grouped_mm: expected Float32, BFloat16 or Float16 operands")
    _check(mat_a.dtype == mat_b.dtype, "_grouped_mm: expected mat_a and mat_b to have the same dtype")
    _check(mat_a.ndim in (2, 3) and mat_b.ndim in (2, 3), "_grouped_mm: mat_a and mat_b have to be 2 or 3d")
    two_d = mat_a.ndim == 2 or mat_b.ndim == 2
    if mat_a.ndim == 3 or mat_b.ndim == 3:
        _check(mat_a.shape[-1] == mat_b.shape[-2], "_grouped_mm: contraction dimension of mat_a and mat_b must match")
    _check((offs is not None) == two_d,
           "_grouped_mm: have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        _check(offs.ndim == 1 and offs.dtype == jnp.int32, "_grouped_mm: offs has to be a 1D int32 tensor")
        if mat_a.ndim != mat_b.ndim:
            groups = mat_b.shape[0] if mat_b.ndim == 3 else mat_a.shape[0]
            _check(offs.shape[0] == groups, "_grouped_mm: matrix batch sizes have to match")
    elif mat_a.ndim == 3:
        _check(mat_a.shape[0] == mat_b.shape[0], "_grouped_mm: batched dimension has to match")
    _check(bias is None, "_grouped_mm: bias is not supported yet")
    _check(out_dtype is None or jdtype(out_dtype) == mat_a.dtype, "_grouped_mm: output dtype must match mat_a's dtype")


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    _validate(mat_a, mat_b, offs, bias, out_dtype)
    want = mat_a.dtype
    if mat_a.ndim == 3 and mat_b.ndim == 3:
        out = jnp.matmul(mat_a, mat_b, preferred_element_type=jnp.float32)
    elif mat_a.ndim == 2 and mat_b.ndim == 3:
        out = lax.ragged_dot(mat_a, mat_b, _group_sizes(offs), preferred_element_type=jnp.float32)
    elif mat_a.ndim == 3 and mat_b.ndim == 2:
        # out.T (N, M): rows of b.T grouped, each against its a[g].T.
        out = lax.ragged_dot(mat_b.T, jnp.swapaxes(mat_a, 1, 2), _group_sizes(offs),
                             preferred_element_type=jnp.float32).T
    else:
        out = _ragged_contract(mat_a, mat_b, _group_sizes(offs))
    return out.astype(want)


# PyTorch's meta kernel copies the CUDA kernel's checks (bf16 only, rows aligned to 16
# bytes) and refuses calls its CPU kernel runs: results are not checked against it.
lower(aten._grouped_mm.default, meta_check=False)(grouped_mm)
