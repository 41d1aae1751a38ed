"""Helpers shared by lowerings: dtype mapping and dim normalisation."""

from __future__ import annotations

import torch

from ..core.dtypes import to_jax_dtype


def jdtype(dtype, default=None):
    """A torch dtype (or None) as a jax dtype."""
    if dtype is None:
        return default
    return to_jax_dtype(dtype)


def default_float():
    return to_jax_dtype(torch.get_default_dtype())


def norm_dim(dim: int, ndim: int) -> int:
    ndim = max(ndim, 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"dimension {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def norm_dims(dims, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(ndim))
    axes = tuple(sorted(norm_dim(d, ndim) for d in dims))
    # A 0-d tensor accepts dim 0 / -1 and reduces over nothing.
    return () if ndim == 0 else axes
