"""Dtype mapping between PyTorch and JAX.

JAX runs with 64-bit types enabled (jax_setup.py) so int64 indices and float64
keep PyTorch's semantics exactly (XLA emulates int64 on TPUs; float64 is not a
TPU type).
"""

from __future__ import annotations

from . import jax_setup

jax_setup.configure()  # before any JAX computation

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    # PyTorch's shell dtypes (few ops): flash attention's rng_state is uint64 (varlen_attn makes one on the device)
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


class UnsupportedDtype(TypeError):
    pass


def to_jax_dtype(dtype: torch.dtype):
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise UnsupportedDtype(f"dtype {dtype} is not supported on the tpu device") from None


def to_torch_dtype(dtype) -> torch.dtype:
    found = _JAX_TO_TORCH.get(dtype)  # arrays carry np.dtype objects: no conversion on the hot path
    if found is not None:
        return found
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise UnsupportedDtype(f"jax dtype {dtype} has no PyTorch equivalent") from None
