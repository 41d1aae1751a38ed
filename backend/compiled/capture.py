"""Capturing a function of tpu tensors as one XLA program: where each graph input came from.

A capture runs the function under the fused recorder with a `Capture` attached:
every array the graph reads is traced back to a tensor argument, a storage that
existed before the call (parameters, optimizer state), the RNG, a Python number
or a small CPU constant. A replay reads the same places again, so no Python of
the function runs. Used by step programs, module programs and optimizer programs.
"""

from __future__ import annotations

import weakref

import torch

from ..core import modes
from ..core.jax_setup import device_x64
from ..core.lazy import Lazy
from ..core.state import RNG
from ..core.tensor import Storage, TpuTensor
from ..core.transfer import materialize
from ..core.views import apply_chain

class Capture:
    """Provenance of graph inputs while a step runs under the recorder."""

    def __init__(self, arg_tensors: dict[int, tuple], state_storages: dict[int, tuple] | None = None):
        self.arg_tensors = arg_tensors  # id(tensor argument) -> its path in (args, kwargs)
        self.owned = dict(state_storages or {})  # id(storage) -> path: module state, base-tensor args
        self.arg_arrays: dict[int, tuple] = {}  # id(array) -> path of the argument
        self.storage_arrays: dict[int, weakref.ref] = {}  # id(array) -> storage
        self.rng_counters: set[int] = set()
        self.rng_bases: set[int] = set()
        self.host_arrays: dict[int, HostConstant] = {}  # id(array) -> a CPU value moved in during the step
        self.fresh_arrays: dict[int, object] = {}  # id(array) -> zeros made inside the step (note_fresh)
        self.problems: list[str] = []
        self.optimizers: list = []
        self.keep: list = []  # arrays noted, kept alive so their ids stay unique

    @classmethod
    def for_arguments(cls, tree, state_storages=None) -> "Capture":
        found = tensor_paths(tree)
        capture = cls({id(t): path for path, t in found}, state_storages)
        for path, t in found:
            capture.owned.setdefault(id(t._storage_box), ("arg", path))
        return capture

    def read(self, tensor: TpuTensor):
        array = self.note_base(tensor)
        if not tensor._view_chain:
            return array
        return apply_chain(array, tensor._view_chain)

    def note_base(self, tensor: TpuTensor):
        """The array of `tensor`'s storage, noted as where a graph input comes from. Also for a write through a
        view, which reads the base it scatters into (DDP copies each gradient into a view of its bucket)."""
        box = tensor._storage_box
        array = box.array
        if type(array) is not Lazy and id(array) not in self.host_arrays and id(array) not in self.fresh_arrays:
            owner = self.owned.get(id(box))
            if owner is not None:
                self.arg_arrays[id(array)] = owner
            else:
                self.storage_arrays[id(array)] = weakref.ref(box)
            self.keep.append(array)
        return array

    def note_fresh(self, array) -> None:
        """Zeros made inside the step for a storage brought back from 0 bytes (FSDP2's unsharded parameters,
        `untyped_storage().resize_()`): a constant of the program, not the storage's value at replay (freed)."""
        self.fresh_arrays[id(array)] = array
        self.keep.append(array)

    def note_rng(self, base, counter) -> None:
        self.rng_bases.add(id(base))
        self.rng_counters.add(id(counter))
        self.keep.extend((base, counter))

    def note_host(self, array, cpu: torch.Tensor) -> None:
        """A CPU tensor moved to the device inside the step (a Python scalar wrapped by PyTorch's
        C++ code, a small constant): a constant of the program, like a Python number."""
        if cpu.numel() > HostConstant.MAX_ELEMENTS:
            self.problems.append(f"it moves a CPU tensor of {cpu.numel()} elements to the device inside the step")
            return
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
        self.host_arrays[id(array)] = HostConstant(array, (tuple(cpu.shape), str(cpu.dtype), raw))
        self.keep.append(array)

    INTERRUPTED = "it needs a concrete value mid-step"

    def interrupted(self, reason: str) -> None:
        self.problems.append(f"{self.INTERRUPTED}: {reason}")

    def provenance(self, inputs) -> list[tuple]:
        out = []
        for value in inputs:
            key = id(value)
            if key in self.arg_arrays:
                out.append(self.arg_arrays[key])
            elif key in self.host_arrays:
                out.append(("host", self.host_arrays[key]))
            elif key in self.fresh_arrays:
                out.append(("fresh", self.fresh_arrays[key]))
            elif key in self.storage_arrays:
                out.append(("storage", self.storage_arrays[key]))
            elif key in self.rng_counters:
                out.append(("rng_counter", None))
            elif key in self.rng_bases:
                out.append(("rng_base", None))
            elif isinstance(value, (float, int)):
                out.append(("number", value))
            else:
                out.append(("constant", None))
                self.problems.append("the step creates device data from the host (a CPU tensor moved inside it)")
        return out


class HostConstant:
    """A small CPU value moved in during a captured step; replays pass the same array, and a
    capture whose host values differ from the last one's is not replayed (see _Plan.key)."""

    MAX_ELEMENTS = 4096

    def __init__(self, array, key: tuple):
        self.array = array
        self.key = key


def tensor_paths(tree, prefix=()) -> list[tuple[tuple, TpuTensor]]:
    found = []
    if isinstance(tree, TpuTensor):
        found.append((prefix, tree))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            found.extend(tensor_paths(v, prefix + (i,)))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            found.extend(tensor_paths(v, prefix + (k,)))
    return found


def get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def signature(tree):
    """What a replay must match: the structure, and the shape and dtype of each tensor."""
    if isinstance(tree, torch.Tensor):
        return ("T", tuple(tree.shape), tree.dtype, tree.device.type)
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__,) + tuple(signature(v) for v in tree)
    if isinstance(tree, dict):
        return ("dict",) + tuple((k, signature(v)) for k, v in sorted(tree.items(), key=lambda kv: str(kv[0])))
    if isinstance(tree, (int, float, bool, str, type(None))):
        return ("V", tree)
    return ("O", id(tree))



def autocast_state() -> tuple:
    """Autocast on tpu changes the captured casts, so a program replays only under the same state."""
    enabled = torch.is_autocast_enabled("tpu")
    return (enabled, torch.get_autocast_dtype("tpu") if enabled else None)


@device_x64()  # a replay's inputs are read outside any op: the key of a 64-bit seed must be made as an op makes it
def rng_input(kind: str, drawn: list):
    """A replay's RNG input: a fresh counter (as an op would draw), or the base key. The base is no
    draw: drawing one for it (graphs list the base before the first counter) shifted every mask
    by one against eager mode's."""
    if kind == "rng_counter":
        drawn[0], counter = RNG.next()
        return counter
    return drawn[0] if drawn[0] is not None else RNG.base()




def replay_key(exe, provenance) -> tuple:
    """What two captures must share for their program to be replayed: the graph, and the Python numbers
    and small CPU constants baked into it."""
    constants = tuple(v.key if kind == "host" else v for kind, v in provenance if kind in ("number", "host"))
    return (id(exe), constants)


def constant_input(kind: str, value, drawn: list):
    """A replay's input that is no tensor: an RNG draw, a CPU constant, or a Python number."""
    if kind in ("rng_counter", "rng_base"):
        return rng_input(kind, drawn)
    if kind == "host":
        return value.array
    return value  # a number, or a fresh array (zeros: the same array every replay)


def rebuild(tree, return_map, values, path=()):
    """The function's return value with each returned tensor replaced by its output (`values[i]`:
    a TpuTensor, or an array wrapped into one). Containers keep their type (a transformers
    ModelOutput stays one, so `.loss` works)."""
    if path in return_map:
        value = values[return_map[path]]
        return value if isinstance(value, torch.Tensor) else TpuTensor(value)
    if isinstance(tree, (list, tuple)):
        items = [rebuild(v, return_map, values, path + (i,)) for i, v in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    if isinstance(tree, dict):
        items = {k: rebuild(v, return_map, values, path + (k,)) for k, v in tree.items()}
        return _same_mapping(tree, items)
    return tree


def _same_mapping(tree: dict, items: dict) -> dict:
    if type(tree) is dict:
        return items
    try:
        return type(tree)(**items)  # dataclass-style mappings (transformers' ModelOutput)
    except TypeError:
        try:
            return type(tree)(items)
        except TypeError:
            return items


def pair_storages(storages, outputs):
    # Each flushed storage now holds its output's value; pair by that value's identity.
    by_value = {id(lz.value): lz for lz in outputs}
    return [(s, by_value[id(s.array)]) for s in storages if id(s.array) in by_value]


def output_of(tensor: TpuTensor, outputs):
    by_value = {id(lz.value): lz for lz in outputs}
    if tensor._view_chain:
        return None
    return by_value.get(id(tensor._storage_box.array))




class RebasedViews:
    """During a capture, a tensor argument that is a view (a batch sliced from a dataset)
    stands on its own storage holding its value: the graph takes that value as an input,
    and views the step derives from it chain from it, not from the dataset."""

    def __init__(self, tree):
        self.views = [t for _, t in tensor_paths(tree) if t._view_chain]
        self.saved = []
        self.written = False

    def __enter__(self):
        for t in self.views:
            with modes.eager_override():  # the value now, outside any graph
                value = t.jax()
                if type(value) is Lazy:
                    value = materialize(t)
            box = Storage(value)
            self.saved.append((t, t._storage_box, t._view_chain, box))
            t._storage_box, t._view_chain, t._cache, t._cache_version = box, (), box.array, box.version
        return self

    def __exit__(self, *exc):
        for t, old_box, chain, box in self.saved:
            t._storage_box, t._view_chain, t._cache_version = old_box, chain, -1
            if box.version:
                self.written = True
                t.set_jax(box.array)
        return False


class compiling:
    """While a step is captured, `torch.compiler.is_compiling()` is True, as under torch.compile:
    library code written for compilation then avoids host reads of device values (transformers
    builds an explicit mask instead of checking `padding_mask.all()`; optimizers keep step
    counters on the device). Same math, one program."""

    def __enter__(self):
        self._old = torch.compiler.is_compiling
        torch.compiler.is_compiling = _true

    def __exit__(self, *exc):
        torch.compiler.is_compiling = self._old
        return False


def _true() -> bool:
    return True

