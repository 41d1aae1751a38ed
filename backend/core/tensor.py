"""The `tpu` tensor: a PyTorch wrapper subclass whose data is a `jax.Array`.

The wrapper lives on the PrivateUse1 device `tpu:k` itself, k the local JAX device its array is on (one process
owns all the host's local devices; see `on_device`). PyTorch's C++ code
creates tensors "on self's device" (a Python scalar in `torch.where(m, x, 0.0)`,
the mask of attention's math path, `new_zeros`); on `tpu:0` they reach our
allocation kernels and hold data. (An earlier wrapper on `meta` lost them.)
JAX arrays are immutable, so PyTorch's mutable storage is modelled by a
`Storage` box shared by a base tensor and its views: a view keeps the chain of
view ops that produced it, reads recompute from the base when the base changed
since, and writes scatter back into the base (see `views.py`).
"""

from __future__ import annotations

import os

import jax
import torch

from . import jax_setup
from .dtypes import _JAX_TO_TORCH, to_torch_dtype
from .lazy import RECORDER, Lazy
from .state import STATE
from .views import apply_chain, scatter_chain

DEVICE = torch.device("tpu", 0)
# `tpu:k` is this process's k-th local JAX device (a chip of the host; simulated CPU devices here).
LOCAL_DEVICES = jax_setup.local_devices()
# Every op runs inside the device's 64-bit scope (jax_setup): JAX's thread-local switch, on for the op's length.
_X64_SWAP, _X64_SET = jax_setup.X64_SWAP, jax_setup.X64_SET
STATE.set_device_count(len(LOCAL_DEVICES))
_TORCH_DEVICES = tuple(torch.device("tpu", i) for i in range(len(LOCAL_DEVICES)))
_POSITION = {d: i for i, d in enumerate(LOCAL_DEVICES)}
# Called with the CPU copy a tpu tensor pickles as, and its device (set by checkpoints.py, which tags the copy's
# storage with the device's location while torch.save runs).
on_pickle = None


class Storage:
    """A mutable box around the base array, shared by all views of it."""

    __slots__ = ("array", "version", "freed", "__weakref__")

    def __init__(self, array):
        self.array = array
        self.version = 0
        self.freed = None  # (shape, dtype) while its memory is given back (`untyped_storage().resize_(0)`)
        if type(array) is Lazy:  # a pending value: this storage is an output of the next flush
            RECORDER.track(self)

    def place(self, array) -> None:
        """Same values, new placement (sharding): views stay valid, so no new version."""
        self.array = array

    def write(self, array) -> None:
        self.array = array
        self.version += 1
        if type(array) is Lazy:
            RECORDER.track(self)

    def nbytes(self) -> int:
        return 0 if self.freed is not None else self.array.size * self.array.dtype.itemsize

    @jax_setup.device_x64()  # reached from `untyped_storage().resize_`, not through an op
    def resize(self, nbytes: int) -> None:
        """`untyped_storage().resize_(n)` as FSDP2 uses it: 0 gives the memory back (the value is lost), the
        full size brings back a zeroed array of the base's shape (to be written into), anything else raises."""
        import jax.numpy as jnp

        if nbytes == 0:
            if self.freed is None:
                self.freed = (tuple(self.array.shape), self.array.dtype)
                self.write(jnp.zeros((0,), self.array.dtype))
            return
        if self.freed is not None:
            shape, dtype = self.freed
            if nbytes == int(jnp.zeros((), dtype).dtype.itemsize * _numel(shape)):
                self.freed = None
                self.write(jnp.zeros(shape, dtype))
                if RECORDER.capture is not None:  # made inside a captured step: a constant of its program
                    RECORDER.capture.note_fresh(self.array)
                return
        if nbytes != self.nbytes():
            raise RuntimeError(f"tpu: a storage can be resized only to 0 bytes and back ({nbytes} bytes asked)")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_TENSOR_DATA = torch._C.TensorBase.data  # PyTorch's own `.data` (TpuTensor.data wraps it)
_VALUE_FIELDS = ("_storage_box", "_view_chain", "_cache", "_cache_version")  # where a tensor's value lives


class TpuTensor(torch.Tensor):
    """A tensor on the `tpu` device; see the module docstring."""

    _storage_box: Storage
    # A base tensor sets only its storage: the class gives the rest (one attribute written per new tensor, not four).
    _view_chain: tuple = ()  # ((op, static args), ...) from the base; () for a base
    _cache: object = None  # a view's value, valid while _cache_version matches
    _cache_version: int = 0

    @staticmethod
    def __new__(cls, array, requires_grad: bool = False, *, storage=None, chain=()):
        index = 0
        if STATE.device_count > 1:
            index = _index_of(array)
            if index and storage is None:
                array = _commit(array, index)
        r = _new_wrapper(cls, tuple(array.shape), dtype=to_torch_dtype(array.dtype), device=_TORCH_DEVICES[index],
                         requires_grad=requires_grad)
        r._storage_box = Storage(array) if storage is None else storage
        if chain:  # a view (detach or alias of a view): its value now, valid for the storage's current version
            r._view_chain = chain
            r._cache = array
            r._cache_version = r._storage_box.version
        return r

    def __init__(self, *args, **kwargs):
        # torch.Tensor.__init__ would complain about our arguments.
        pass

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new) -> None:
        """`p.data = t`: PyTorch swaps the C++ tensor's metadata; the values live in this object's fields, so they
        are swapped too (without that the assignment was silently lost: an init or weight-loading `.data =` kept
        the old values). The old `.data` aliases keep the old values, as on CUDA."""
        if not isinstance(new, TpuTensor):
            raise RuntimeError(f"tpu: `.data` of a tensor on {self.device} set to a tensor on "
                               f"{getattr(new, 'device', type(new).__name__)}: move it first (`.to('{self.device}')`)")
        _TENSOR_DATA.__set__(self, new)  # shape, dtype, device: PyTorch's own checks
        mine, theirs = vars(self), vars(new)
        for name in _VALUE_FIELDS:
            if name in theirs:
                mine[name] = theirs[name]
            else:
                mine.pop(name, None)

    # C++ would read a data pointer the wrapper does not have: copy to the CPU first.
    def tolist(self):
        return self.detach().cpu().tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(
                f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
            )
        return self.detach().cpu().numpy()

    # --- value --------------------------------------------------------------
    def jax(self):
        """The current `jax.Array` value (recomputed from the base for a stale view)."""
        box = self._storage_box
        if RECORDER.capture is not None:
            return RECORDER.capture.read(self)
        if not self._view_chain:
            return box.array
        cache = self._cache
        if type(cache) is Lazy:
            if cache.value is not None:
                self._cache = cache.value
            elif cache.node is None or cache.node.order < RECORDER.order - RECORDER.since_flush:
                # A pending read whose graph ran without it, or one recorded before the last flush, which did
                # not compute it and may have consumed its inputs (their nodes cut): read again.
                self._cache_version = -1
        if self._cache_version != box.version:
            self._cache = apply_chain(box.array, self._view_chain)
            self._cache_version = box.version
        return self._cache

    def set_jax(self, value) -> None:
        """Replace this tensor's value in place (a write through a view updates its base)."""
        box = self._storage_box
        if not self._view_chain:  # a base reads its storage: no cache to keep
            box.write(value)
            return
        if RECORDER.capture is not None:  # the base it scatters into is a graph input
            RECORDER.capture.note_base(self)
        box.write(scatter_chain(box.array, self._view_chain, value))
        self._cache = value
        self._cache_version = box.version

    def __repr__(self, *, tensor_contents=None):
        body = repr(self.detach().cpu())
        if body.endswith(")"):
            extra = f", device='{self.device}'"
            if self.requires_grad and "requires_grad" not in body and "grad_fn" not in body:
                extra += ", requires_grad=True"
            if self.grad_fn is not None and "grad_fn" not in body:
                extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
            body = body[:-1] + extra + ")"
        return body

    def untyped_storage(self):
        """The wrapper's storage, whose data pointer names the shared value (one per `Storage`
        box, so views share it): libraries that tell shared tensors apart by it (safetensors'
        save_file, transformers' save_pretrained) work; the real pointer does not exist."""
        storage = super().untyped_storage()
        box = self._storage_box
        storage.data_ptr = lambda: id(box)
        storage.size = storage.nbytes = box.nbytes  # FSDP2 frees and re-allocates unsharded parameters
        storage.resize_ = box.resize
        return storage

    def data_ptr(self):
        """A base tensor starts where its storage does (see `untyped_storage`); a view's
        address is unknown (0, as the bare wrapper says)."""
        return 0 if self._view_chain else id(self._storage_box)

    def __reduce_ex__(self, protocol):
        # Pickling stores the CPU value, so a checkpoint loads anywhere; under torch.save its storage is tagged
        # with this device's location, as a CUDA tensor's is, so torch.load restores it here (checkpoints.py).
        value = self.detach().cpu().requires_grad_(self.requires_grad)
        if on_pickle is not None:
            on_pickle(value, str(self.device))
        if isinstance(self, torch.nn.Parameter):  # a module's parameter (the tensor itself, swapped in by .to)
            return torch._utils._rebuild_parameter, (value.detach(), self.requires_grad, {})
        return value.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        """`copy.deepcopy` (a model's copy for EMA or the best checkpoint): a clone on tpu. torch.Tensor's own would
        copy the PyTorch storage, which a tpu tensor only imitates (the process crashed)."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
        if isinstance(self, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        elif self.requires_grad and self.is_leaf:
            new.requires_grad_(True)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        return new

    # Declaring the subclass "traceable" makes `Module.to("tpu")` swap parameters in
    # place (torch.utils.swap_tensors) instead of replacing them, which keeps tied
    # weights tied. Its data is not a torch tensor, so there is nothing to flatten.
    def __tensor_flatten__(self):
        return [], (self._storage_box, self._view_chain)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        raise NotImplementedError("tpu tensors cannot be rebuilt from inner tensors")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        previous = _X64_SWAP(True)  # not `with device_x64()`: a context object costs more on every op
        try:
            if STATE.device_count == 1:
                return _dispatch(func, args, kwargs or {})
            kwargs = kwargs or {}
            index = op_device(func, args, kwargs)
            if STATE.fused:
                _one_device_per_graph(index)
            return on_device(index, _dispatch, func, args, kwargs)
        finally:
            _X64_SET(previous)


_new_wrapper = torch.Tensor._make_wrapper_subclass
_TORCH_DTYPES = _JAX_TO_TORCH  # np.dtype -> torch.dtype


def wrap(array) -> TpuTensor:
    """`TpuTensor(array)`, a new base tensor, on the path of every op: on one device, with no `__init__` call,
    keyword parsing or device lookup."""
    if STATE.device_count > 1:
        return TpuTensor(array)
    dtype = _TORCH_DTYPES.get(array.dtype)
    r = _new_wrapper(TpuTensor, array.shape, dtype=dtype or to_torch_dtype(array.dtype), device=DEVICE)
    r._storage_box = Storage(array)
    return r


# --- several local devices ------------------------------------------------------------------------------------


_fused_on = [None]  # the device of the ops recorded since the last flush (fused mode)


def _one_device_per_graph(index: int) -> None:
    """A fused graph runs on one device: what is pending on another runs first."""
    if _fused_on[0] != index:
        if _fused_on[0] is not None and RECORDER.capture is None:
            RECORDER.flush(f"an op on tpu:{index} after ops on tpu:{_fused_on[0]}")
        _fused_on[0] = index


def _index_of(array) -> int:
    """The device a new tensor is on: the running op's, else the one its array is committed to, else the
    current device."""
    if STATE.op_device is not None:
        return STATE.op_device
    if type(array) is Lazy:  # a pending value made outside an op (a compiled module's outputs): its inputs'
        return _pending_index(array)
    found = _committed_index(array)
    return STATE.device if found is None else found


def _committed_index(array):
    if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer) and array.committed:
        devices = array.devices()
        if len(devices) == 1:
            return _POSITION.get(next(iter(devices)))
    return None


def _pending_index(lazy, limit: int = 256) -> int:
    """The device of the first concrete input found behind a pending value (the graph runs where they are)."""
    todo, seen = [lazy.node], set()
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for value in node.inputs:
            if type(value) is Lazy:
                if value.value is not None:
                    value = value.value
                else:
                    todo.append(value.node)
                    continue
            found = _committed_index(value)
            if found is not None:
                return found
    return STATE.device


def _commit(array, index: int):
    """A concrete one-device array committed to local device `index`, so that the programs it feeds run there
    (jit follows committed inputs); pending and traced values and sharded arrays as they are."""
    if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer) and not array.committed:
        if len(array.devices()) == 1:
            return jax.device_put(array, LOCAL_DEVICES[index])
    return array


def _local_rank() -> int | None:
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


def check_index(index: int) -> int:
    """`index` if it names a local device. Under a launcher with one device per process (torchrun, one process
    per chip), `tpu:LOCAL_RANK` names the process's own device, tpu:0, as `cuda:LOCAL_RANK` names a GPU rank's."""
    count = STATE.device_count
    if 0 <= index < count:
        return index
    if count == 1 and index == _local_rank():
        return 0
    last = "tpu:0" if count == 1 else f"tpu:0 to tpu:{count - 1}"
    raise RuntimeError(f"tpu: invalid device ordinal {index} (out of range: this process has {count} tpu "
                       f"device{'s' if count > 1 else ''}, {last})")


def device_index(device) -> int:
    """A tpu device (torch.device, 'tpu:k', an int, or None or 'tpu' for the current device) as a local index."""
    if device is None:
        return STATE.device
    if not isinstance(device, int):
        device = torch.device(device).index
        if device is None:
            return STATE.device
    return check_index(device)


_aten = torch.ops.aten
_TO_COPY = _aten._to_copy.default
_INTO_FIRST = {_aten.copy_.default, _aten.set_.source_Tensor}  # written into args[0] from another device
_COPY_FROM = {_aten._copy_from.default, _aten._copy_from_and_resize.default}  # (src, dst)


def _tpu_index(x):
    return x.device.index if isinstance(x, TpuTensor) else None


def op_device(func, args, kwargs) -> int:
    """The device an op runs on: its tensors' (all on one device, else the error CUDA gives), a factory's
    `device=`; copies run on their destination's device."""
    target = kwargs.get("device")
    if func is _TO_COPY:
        if target is not None and torch.device(target).type == "tpu":
            return device_index(target)
        index = _tpu_index(args[0])
        return STATE.device if index is None else index
    if func in _INTO_FIRST or func in _COPY_FROM:
        index = _tpu_index(args[1] if func in _COPY_FROM else args[0])
        return STATE.device if index is None else index
    found = None
    for arg in (*args, *kwargs.values()):
        for x in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(x, TpuTensor):
                index = x.device.index
                if found is None:
                    found = index
                elif index != found:
                    raise RuntimeError(f"{func}: expected all tensors to be on the same device, but found at "
                                       f"least two devices, tpu:{found} and tpu:{index}!")
    if target is not None and not isinstance(target, int) and torch.device(target).type == "tpu":
        return device_index(target)  # new_zeros(..., device="tpu:1")
    return STATE.device if found is None else found


def on_device(index: int, fn, *args):
    """Run `fn(*args)` as an op on local device `index`: the tensors it makes are on `tpu:index`, and the arrays
    JAX makes without committed inputs land there."""
    previous = STATE.op_device
    STATE.set_op_device(index)
    try:
        with jax.default_device(LOCAL_DEVICES[index]):
            return fn(*args)
    finally:
        STATE.set_op_device(previous)


def _dispatch(func, args, kwargs):
    """The device's one entry point, until dispatch.py installs the real one (`install_dispatcher`).

    dispatch.py builds tensors of this class, so this module cannot import it: the
    dispatcher registers itself when it loads. It loads before any tensor can reach
    here: every first op on `tpu` (a factory, an allocation, a copy from the CPU)
    enters through the device's kernels (device.py), which import dispatch.py."""
    raise RuntimeError(f"{func}: the tpu dispatcher is not loaded (import tpu_agent.backend.aten.dispatch first)")


def install_dispatcher(dispatch) -> None:
    """Route every op on a `TpuTensor` to `dispatch(func, args, kwargs)` (called by dispatch.py on import)."""
    global _dispatch
    _dispatch = dispatch
