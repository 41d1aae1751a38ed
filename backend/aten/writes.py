"""A result written into a tpu tensor in place.

JAX arrays are immutable: a mutating op runs functionally, and its new values are written back here into
the target's storage (through its view chain), cast to the target's dtype and broadcast to its shape as
PyTorch's in-place ops do. A tpu tensor cannot be resized in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core import dtypes
from .arguments import device_mismatch
from ..core.lazy import Lazy
from ..core.programs import call_jax
from ..core.tensor import TpuTensor


def write(func, target, value) -> None:
    if isinstance(target, (list, tuple)):
        for t, v in zip(target, value):
            write(func, t, v)
        return
    if target is None:
        return
    if not isinstance(target, TpuTensor):
        if isinstance(target, torch.Tensor):
            raise device_mismatch(func, target, 0)
        return
    array = value.jax() if isinstance(value, TpuTensor) else value
    if not isinstance(array, (jax.Array, Lazy)):
        array = jnp.asarray(array)
    want = dtypes.to_jax_dtype(target.dtype)
    if tuple(array.shape) != tuple(target.shape):
        if array.size == 0 or target.numel() == 0 or tuple(target.shape) != jnp.broadcast_shapes(array.shape, target.shape):
            raise RuntimeError(
                f"{func}: cannot write a result of shape {tuple(array.shape)} into a tpu tensor of shape "
                f"{tuple(target.shape)} (resizing tpu tensors in place is not supported)"
            )
        array = broadcast_cast(array, tuple(target.shape), want)
    elif array.dtype != want:
        array = cast(array, want)
    target.set_jax(array)


def cast(array, dtype):
    want = jnp.dtype(dtype)
    return call_jax(("cast", array.shape, str(array.dtype), str(want)), "cast", lambda a: a.astype(want), array)


def broadcast_cast(array, shape, dtype):
    want = jnp.dtype(dtype)
    key = ("broadcast_cast", array.shape, str(array.dtype), shape, str(want))
    return call_jax(key, "broadcast_cast", lambda a: jnp.broadcast_to(a, shape).astype(want), array)
