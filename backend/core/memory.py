"""Device memory figures for `torch.tpu.*` and `torch.accelerator.*` memory functions.

`torch.accelerator.memory_stats()` and its family ask the C++ caching allocator, which a
Python backend does not have (PyTorch fails an internal assert). JAX owns device memory:
where its device reports statistics (TPU, GPU) they are used; otherwise (the CPU
platform) the bytes held by live arrays are counted. Peaks are the highest figure seen,
since the start or the last `reset_peak_memory_stats()` (STATE.memory_peaks).
"""

from __future__ import annotations

import sys
import types
import weakref
from collections import OrderedDict

from .state import STATE


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

    used = live_bytes(jax.live_arrays())
    return used, used, None


def live_bytes(arrays) -> int:
    """Bytes the given live arrays hold on this process's device: the one count of live device memory (the
    profiler's, `torch.tpu.memory_allocated`'s and a CUDA script's `torch.cuda.memory_allocated`'s)."""
    return sum(_device_bytes(a) for a in arrays if not a.is_deleted())


def memory_stats(device=None) -> OrderedDict:
    used, reserved, _ = _current()
    peaks = STATE.memory_peaks
    peaks.allocated = max(peaks.allocated, used)
    peaks.reserved = max(peaks.reserved, reserved)
    return OrderedDict(sorted({
        "allocated_bytes.all.current": used,
        "allocated_bytes.all.peak": peaks.allocated,
        "reserved_bytes.all.current": reserved,
        "reserved_bytes.all.peak": peaks.reserved,
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
    STATE.memory_peaks.allocated = STATE.memory_peaks.reserved = 0


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
ACCELERATOR_FUNCTIONS = types.MappingProxyType({
    "memory_stats": memory_stats,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_reserved,
    "max_memory_reserved": max_memory_reserved,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
    "empty_cache": empty_cache,
    "get_memory_info": mem_get_info,
})


def route_accelerator_memory() -> None:
    """Send torch.accelerator's memory functions here (tpu is the process's accelerator)."""
    import torch.accelerator as accelerator
    import torch.accelerator.memory as accelerator_memory

    for name, fn in ACCELERATOR_FUNCTIONS.items():
        for namespace in (accelerator, accelerator_memory):
            if hasattr(namespace, name):
                setattr(namespace, name, fn)


class StepPeak:
    """The in-step peak: the most bytes alive on this process's device at any program launch inside a step,
    plus that program's own temporary bytes (XLA's memory analysis).

    Why: bytes alive at a step boundary miss what a step holds and frees inside it: FSDP2's parameters
    unsharded between forward and backward, activations kept for the backward. Every array a launch
    returns is counted until it is freed (a weak reference's callback). At each step's end the count is set
    again from the arrays alive: an array made outside a launch (a transfer, a collective's output) counts
    from then on, and inside the step that made it only if it is still alive at its end.
    One reader per process calls `end_step()` at each boundary, after it has taken its step time.
    """

    def __init__(self) -> None:
        self._sizes: dict[int, int] = {}  # id(array) -> its bytes on the device, while alive
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self._launches: dict[int, list] = {}  # executable id -> [most bytes alive after a launch of it, executable]
        self._temp: dict[int, int] = {}  # executable id -> its temporary bytes
        self._start: int | None = None  # bytes alive when the step began; None: not counted yet (no JAX call
        # before the first launch: a rank's jax.distributed.initialize must come first)

    def _watch(self, array) -> None:
        key = id(array)
        if key in self._sizes:
            return
        size = _device_bytes(array)
        self._sizes[key] = size
        self.current += size
        self._refs[key] = weakref.ref(array, lambda _ref, key=key: self._freed(key))

    def _freed(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def launched(self, exe, out) -> None:
        """After a launch: its outputs are alive, its inputs still are (or were donated to them)."""
        import jax

        if self._start is None:
            self._start = self._resync()
        if isinstance(out, jax.Array):
            self._watch(out)
        else:
            for leaf in jax.tree_util.tree_leaves(out):
                if isinstance(leaf, jax.Array):
                    self._watch(leaf)
        seen = self._launches.get(exe.id)
        if seen is None:
            self._launches[exe.id] = [self.current, exe]
        elif seen[0] < self.current:
            seen[0] = self.current

    def end_step(self) -> int:
        """The step's peak in bytes (at least the bytes alive at its start and at its end); starts the next step."""
        peak = self._start or 0
        for alive, exe in self._launches.values():
            peak = max(peak, alive + self._temp_bytes(exe))
        self._launches.clear()
        self._start = self._resync()
        return max(peak, self._start)

    def _temp_bytes(self, exe) -> int:
        if exe.id not in self._temp:
            try:  # the executable's compile is cached by JAX: this lowers and looks it up
                self._temp[exe.id] = int(exe.memory().get("temp_bytes", 0))
            except Exception:  # noqa: BLE001 - a program XLA cannot analyse adds no temporaries
                self._temp[exe.id] = 0
        return self._temp[exe.id]

    def _resync(self) -> int:
        """Count every live array (donated ones are gone): the bytes alive now, exactly."""
        import jax

        alive = {id(a): a for a in jax.live_arrays() if not a.is_deleted()}
        for key in list(self._sizes):  # a list: a callback may free another array meanwhile
            if key not in alive:
                self._freed(key)
        for array in alive.values():
            self._watch(array)
        self.current = sum(list(self._sizes.values()))
        return self.current


def _device_bytes(array) -> int:
    """Bytes of `array` on one device: a sharded array holds one shard there."""
    size = array.size * array.dtype.itemsize
    sharding = array.sharding
    if not sharding.is_fully_replicated:  # one device's array is: the cheap test first
        shard = 1
        for dim in sharding.shard_shape(array.shape):
            shard *= dim
        size = shard * array.dtype.itemsize
    return size


def watch_step_peaks() -> StepPeak:
    """Start measuring each step's in-step peak (the profiler and the tuner's trial child do); one watcher per
    process, held in STATE.memory_watch, which launch.py reports every launch to."""
    if STATE.memory_watch is None:
        STATE.set_memory_watch(StepPeak())
    return STATE.memory_watch


class _Module(types.ModuleType):
    """launch.py reads `memory.WATCH` on every launch: the name kept, as a read-only view of STATE.memory_watch
    (a property of the module's class: Python's documented way to give a module one), until it reads STATE."""

    @property
    def WATCH(self) -> StepPeak | None:  # noqa: N802 - the name launch.py reads
        """STATE.memory_watch, read-only: launch.py's name for it."""
        return STATE.memory_watch


sys.modules[__name__].__class__ = _Module
