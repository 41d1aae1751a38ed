"""Host <-> device: a CPU tensor's value onto the device, a device value back to the CPU,
and the concrete value of a tensor whose value is still pending in a fused graph."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import dtypes, lazy
from .jax_setup import device_x64
from .launch import out_of_memory_as_torch
from .lazy import RECORDER
from .state import STATE, STATS
from .tensor import LOCAL_DEVICES, TpuTensor

h2d_watch = None  # the profiler's: called with each CPU tensor copied to the device (where batches arrive)


def from_cpu(t: torch.Tensor):
    """A CPU tensor's value as a device array."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    if h2d_watch is not None:
        h2d_watch(t)
    STATS.h2d_count += 1
    STATS.h2d_bytes += t.numel() * t.element_size()
    if t.dtype == torch.bfloat16:
        host = t.view(torch.int16).numpy().view(jnp.bfloat16)
    else:
        host = t.numpy()
    # A copy, as `.to()` is: jnp.asarray may alias the CPU tensor's memory (JAX's CPU client does, zero-copy),
    # and a later in-place write to the CPU tensor would then change the device value.
    want = dtypes.to_jax_dtype(t.dtype)
    array = jnp.array(host, dtype=want, copy=True)
    if array.dtype != want:  # outside the device's 64-bit scope JAX narrows int64 / float64 without a word
        raise _outside_scope(t.dtype, array.dtype, "a copy to the device")
    if STATE.op_device:  # copied to tpu:k, k > 0: its array committed to local device k
        array = jax.device_put(array, LOCAL_DEVICES[STATE.op_device])
    if RECORDER.capture is not None:
        RECORDER.capture.note_host(array, t)
    return array


def materialize(t: TpuTensor, op: str | None = None):
    """The tensor's concrete array, running pending fused work first (`op` reads it)."""
    value = t.jax()
    if type(value) is lazy.Lazy:
        RECORDER.flush(lazy.HOST_READ, also=[value], op=op)
        value = value.value if value.value is not None else t.jax()
        if type(value) is lazy.Lazy:  # a stale pending read: its base is concrete now
            RECORDER.flush(lazy.HOST_READ, also=[value], op=op)
            value = value.value
    return value


def to_cpu(t: TpuTensor) -> torch.Tensor:
    """A device tensor's value, copied to a new CPU tensor."""
    value = materialize(t, "a copy to the CPU")
    with out_of_memory_as_torch("a copy to the CPU"):
        host = np.asarray(jax.device_get(value))
    STATS.d2h_count += 1
    STATS.d2h_bytes += host.nbytes
    if host.dtype == jnp.bfloat16:
        out = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    else:
        out = torch.from_numpy(np.array(host, copy=True))
    if out.dtype != t.dtype:
        raise _outside_scope(t.dtype, out.dtype, "a copy to the CPU")
    return out.reshape(t.shape)


def _outside_scope(want, got, what: str) -> RuntimeError:
    return RuntimeError(f"tpu: {what} of a {want} tensor gave {got}: JAX ran outside the device's 64-bit scope "
                        f"(jax_setup.device_x64); this is a bug of the device, please report it")


@device_x64()
def synchronize() -> None:
    """Run pending fused work, then block until every live device array is computed."""
    RECORDER.flush("synchronize")
    for array in jax.live_arrays():
        array.block_until_ready()


def to_device(t: TpuTensor, index: int):
    """A tpu tensor's value copied to local device `index` (a copy between tpu:j and tpu:k)."""
    value = materialize(t, f"a copy to tpu:{index}")
    with out_of_memory_as_torch(f"a copy to tpu:{index}"):
        return jax.device_put(value, LOCAL_DEVICES[index])
