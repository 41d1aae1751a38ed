"""Device memory figures for `torch.tpu.*` and `torch.accelerator.*` memory functions.

`torch.accelerator.memory_stats()` and its family ask the C++ caching allocator, which a
Python backend does not have (PyTorch fails an internal assert). JAX owns device memory:
where its device reports statistics (TPU, GPU) they are used; otherwise (the CPU
platform) the bytes held by live arrays are counted. Peaks are the highest figure seen,
since the start or the last `reset_peak_memory_stats()`.
"""

from __future__ import annotations

from collections import OrderedDict

_PEAK = {"allocated": 0, "reserved": 0}


def _device():
    import jax

    return jax.local_devices()[0]  # this process's: in a multi-process job devices()[0] is rank 0's


def _current() -> tuple[int, int, int | None]:
    """(bytes in use, bytes reserved, bytes limit or None) on the device."""
    stats = _device().memory_stats()
    if stats:
        used = int(stats.get("bytes_in_use", 0))
        return used, int(stats.get("bytes_reserved", used)), stats.get("bytes_limit")
    import jax

    used = sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())
    return used, used, None


def memory_stats(device=None) -> OrderedDict:
    used, reserved, _ = _current()
    _PEAK["allocated"] = max(_PEAK["allocated"], used)
    _PEAK["reserved"] = max(_PEAK["reserved"], reserved)
    return OrderedDict(sorted({
        "allocated_bytes.all.current": used,
        "allocated_bytes.all.peak": _PEAK["allocated"],
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": _PEAK["reserved"],
    }.items()))


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None) -> None:
    _PEAK.update(allocated=0, reserved=0)


def reset_accumulated_memory_stats(device=None) -> None:
    return None


def empty_cache() -> None:
    """Nothing to release: JAX frees a buffer when its last array goes."""
    return None


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes; total is the device's limit, or the emulated generation's HBM."""
    used, _, limit = _current()
    if not limit:
        from .generations import current_generation

        limit = current_generation().hbm_bytes
    return max(int(limit) - used, 0), int(limit)


# torch.accelerator's name -> ours
ACCELERATOR_FUNCTIONS = {
    "memory_stats": memory_stats,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_reserved,
    "max_memory_reserved": max_memory_reserved,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
    "empty_cache": empty_cache,
    "get_memory_info": mem_get_info,
}


def route_accelerator_memory() -> None:
    """Send torch.accelerator's memory functions here (tpu is the process's accelerator)."""
    import torch.accelerator as accelerator
    import torch.accelerator.memory as accelerator_memory

    for name, fn in ACCELERATOR_FUNCTIONS.items():
        for namespace in (accelerator, accelerator_memory):
            if hasattr(namespace, name):
                setattr(namespace, name, fn)
