"""The device's state in one object: eager mode, matmul precision, PadOps, mesh, launch flags, RNG, counters,
memory peaks, step boundaries, the executables compiled, the fused-graph recorder, and what torch.distributed on
the device keeps between calls.

`STATE` (a `DeviceState`) is the only instance. Its fields are written through its setters alone, and
each setter recomputes what the hot path reads, so an op reads one attribute where it would read several:
`cache_key_extra` (precision, pad multiple, pad sizes: part of every op's compile-cache key), `fused`
(record into the pending graph rather than run) and `blocking` (wait for every launch). The environment
variables that set the initial values are read where they were (modes.py, padding.py); the user-facing
switches (`torch.tpu.set_eager_mode`, `precision`, `sharding.set_mesh`, the PadOps action) call these setters.
The objects it holds (the RNG, the counters, the memory peaks, the distributed state) are written field by field
by the modules that own them; no backend module keeps mutable state of its own at module level
(tests/backend/test_state.py).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from itertools import count

from tpu_agent import envvars


class EagerMode(enum.Enum):
    DEFER_NEVER = "defer_never"  # op by op, asynchronous (the default)
    DEFER_NEVER_AND_LAUNCH_BLOCKING = "defer_never_and_launch_blocking"  # op by op, each op waited for
    DEFER_AND_FUSE = "defer_and_fuse"  # ops recorded and fused into XLA graphs at sync points


class Precision(enum.Enum):
    DEFAULT = "default"  # on TPUs: f32 matmuls as one bf16 pass
    HIGH = "high"  # three bf16 passes
    HIGHEST = "highest"  # full f32


_FUSE = EagerMode.DEFER_AND_FUSE
_BLOCKING = EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING


@dataclass
class Stats:
    """What the profiler reads: fallbacks, transfers, compilations."""

    ops: int = 0
    compiles: int = 0
    fallbacks: Counter = field(default_factory=Counter)
    h2d_count: int = 0
    h2d_bytes: int = 0
    d2h_count: int = 0
    d2h_bytes: int = 0

    def reset(self) -> None:
        self.__init__()


@dataclass
class MemoryPeaks:
    """The most device bytes seen allocated and reserved, since the start or `reset_peak_memory_stats()`
    (memory.py)."""

    allocated: int = 0
    reserved: int = 0


class Recording:
    """What the profiler reads of the collectives (collectives.record): whether each is timed, the totals by
    (op, the group's global ranks), and how many were met while tracing a program (not timed)."""

    __slots__ = ("on", "totals", "untimed")

    def __init__(self) -> None:
        self.on = False
        self.totals: dict = {}  # (op, ranks) -> collectives.Totals
        self.untimed = 0


class CollectiveState:
    """collectives.py's: each group's one-axis mesh and each (collective, group, static arguments)' program, built
    once; how many collective programs ran on their own (between other programs); the profiler's record."""

    __slots__ = ("meshes", "programs", "runs", "recording")

    def __init__(self) -> None:
        self.meshes: dict = {}  # the group's global ranks -> jax.sharding.Mesh
        self.programs: dict = {}  # (kind, ranks, static) -> a jitted shard_map
        self.runs = 0
        self.recording = Recording()


class InProgramState:
    """in_program.py's: the collectives as nodes of fused graphs (one per key, with ids counting down from -1,
    below the executables'), and the pending graph's collectives: their outputs kept until it runs, their
    groups, each group's mesh axis while a graph over several groups is traced, and the reasons already said
    for graphs over groups that share no mesh."""

    __slots__ = ("programs", "ids", "kept", "groups", "axes", "unmeshed")

    def __init__(self) -> None:
        self.programs: dict = {}  # (kind, ranks, shape, dtype, static) -> in_program.CollectiveProgram
        self.ids = count(-1, -1)
        self.kept: list = []
        self.groups: list[tuple[int, ...]] = []
        self.axes: dict = {}  # ranks -> a mesh axis name, or a tuple of them
        self.unmeshed: set[str] = set()


class FaultState:
    """faults.py's: the groups watched (their global ranks -> store, rank, timeout), the collectives this rank
    entered over each (count, last op), the one running now, and the thread that watches them."""

    __slots__ = ("groups", "entered", "current", "thread", "leaving")

    def __init__(self) -> None:
        self.groups: dict = {}
        self.entered: dict[tuple[int, ...], tuple[int, str]] = {}
        self.current = None  # faults._Waiting while a collective runs
        self.thread = None
        self.leaving = None  # threading.Event: set at exit, when the thread must leave before the interpreter ends


class DistributedState:
    """torch.distributed on the device (backend/distributed/): the job this process joined (runtime.Launch, None
    until it joins one), how many tpu process groups it made (each one's gloo gets its own store prefix), and
    the state of the collectives, of the collectives inside programs and of the watch."""

    __slots__ = ("joined", "groups_made", "collectives", "in_program", "faults")

    def __init__(self) -> None:
        self.joined = None
        self.groups_made = 0
        self.collectives = CollectiveState()
        self.in_program = InProgramState()
        self.faults = FaultState()


class StepState:
    """steps.py's: who is told at each step boundary, whether a compiled step's capture holds the boundaries back
    (the step ends when the captured call does), and the elements each optimizer updates (id -> count, at its
    first step: the profile's `parameters`)."""

    __slots__ = ("listeners", "suspended", "trained")

    def __init__(self) -> None:
        self.listeners: list = []
        self.suspended = False
        self.trained: dict[int, int] = {}


class ExecutableState:
    """executables.py's: every executable compiled in this process, oldest first, and the ids they and the
    compiled programs' graph nodes take (one sequence, so the profiler's tables never mix two up)."""

    __slots__ = ("registry", "ids")

    def __init__(self) -> None:
        self.registry: list = []
        self.ids = count()


class Rng:
    """Counter-based on-device RNG: key = fold_in(PRNGKey(seed), counter).

    The key is derived inside each jitted random op, so drawing costs no extra
    dispatch; `torch.manual_seed` resets seed and counter, which makes runs
    reproducible.
    """

    def __init__(self) -> None:
        self.seed: int | None = None
        self.counter = 0
        self._base = None

    def manual_seed(self, seed: int) -> None:
        self.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.counter = 0
        self._base = None

    def initial_seed(self) -> int:
        if self.seed is None:
            import torch

            self.manual_seed(torch.initial_seed())
        return self.seed

    def base(self):
        """The seed's key (no draw)."""
        if self._base is None:
            import jax
            import numpy as np

            self._base = jax.random.PRNGKey(np.uint64(self.initial_seed()))
        return self._base

    def next(self):
        """(base key, counter) to pass to a random lowering."""
        import numpy as np

        base = self.base()
        self.counter += 1
        return base, np.uint32(self.counter)

    def get_state(self) -> tuple[int, int]:
        return self.initial_seed(), self.counter

    def set_state(self, seed: int, counter: int) -> None:
        self.manual_seed(seed)
        self.counter = int(counter)


class DeviceState:
    """Every switch and counter of the device (see the module's docstring); set through the setters only."""

    __slots__ = (
        # inputs, each with its setter
        "mode", "eager_override", "precision", "pad_multiple", "pad_sizes", "mesh",
        "serialize_programs", "time_executables",
        # the current device (torch.tpu.set_device), the local device count (tensor.py sets it when JAX starts),
        # and the device of the op running now (tensor.on_device), which the tensors it makes are on
        "device", "device_count", "op_device",
        # derived by _derive, read on the hot path
        "cache_key_extra", "fused", "blocking",
        # objects held
        "rng", "stats", "recorder", "memory_peaks", "memory_watch", "distributed", "steps", "executables",
    )

    def __init__(self) -> None:
        self.mode = EagerMode.DEFER_NEVER  # modes.py applies $TORCH_TPU_DEFER_AND_FUSE when it loads
        self.eager_override = False  # op by op for a moment, the fused graph kept (modes.eager_override)
        self.precision = Precision.DEFAULT
        self.pad_multiple = 0  # padding.py applies $TPU_AGENT_PAD_OPS when it loads
        self.pad_sizes: frozenset[int] = frozenset()
        self.mesh = None  # a jax.sharding.Mesh (mesh.set_mesh)
        # XLA's CPU client deadlocks when two programs with collectives over simulated devices are in
        # flight at once: mesh.set_mesh turns this on for such meshes.
        self.serialize_programs = False
        # Wait for every executable so its recorded time is execution time, not dispatch time (the
        # profiler turns it on for its per-executable table; modes.py applies $TPU_AGENT_TIME_EXECUTABLES).
        self.time_executables = False
        self.device = 0
        self.device_count = 1
        self.op_device = None
        self.rng = Rng()
        self.stats = Stats()
        self.recorder = None  # lazy.RECORDER, attached when lazy.py loads
        self.memory_peaks = MemoryPeaks()
        self.memory_watch = None  # a memory.StepPeak while the in-step peak is measured (launch.py reports to it)
        self.distributed = DistributedState()
        self.steps = StepState()
        self.executables = ExecutableState()
        self._derive()

    def _derive(self) -> None:
        self.cache_key_extra = (self.precision, self.pad_multiple, self.pad_sizes)
        self.fused = self.mode is _FUSE and not self.eager_override
        self.blocking = self.time_executables or self.serialize_programs or self.mode is _BLOCKING

    # --- setters ---------------------------------------------------------------------
    def set_mode(self, mode: EagerMode) -> None:
        """Leaving fused mode runs what is pending first."""
        if self.mode is _FUSE and mode is not _FUSE and self.recorder is not None:
            self.recorder.flush("left fused mode")
        self.mode = mode
        self._derive()

    def set_eager_override(self, on: bool) -> None:
        self.eager_override = on
        self._derive()

    def set_precision(self, precision: Precision) -> None:
        self.precision = precision
        self._derive()

    def set_padding(self, multiple: int, sizes=()) -> None:
        if multiple < 0 or any(s < 1 for s in sizes):
            raise ValueError("the padding multiple must be >= 0 and the target sizes >= 1")
        self.pad_multiple, self.pad_sizes = int(multiple), frozenset(int(s) for s in sizes)
        self._derive()

    def set_mesh(self, mesh, serialize_programs: bool = False) -> None:
        self.mesh = mesh
        self.serialize_programs = bool(serialize_programs)
        self._derive()

    def set_time_executables(self, on: bool) -> None:
        self.time_executables = bool(on)
        self._derive()

    def set_device(self, index: int) -> None:
        self.device = int(index)

    def set_device_count(self, count: int) -> None:
        self.device_count = int(count)

    def set_op_device(self, index) -> None:
        self.op_device = index

    def attach_recorder(self, recorder) -> None:
        self.recorder = recorder

    def set_memory_watch(self, watch) -> None:
        """Measure each step's in-step peak with `watch` (a memory.StepPeak), or stop with None."""
        self.memory_watch = watch


STATE = DeviceState()
STATS = STATE.stats  # the same objects, one lookup fewer where they are counted on every op
RNG = STATE.rng


def cpu_fallback_enabled() -> bool:
    return envvars.CPU_FALLBACK.value
