"""The `tpu` tensor: a PyTorch wrapper subclass whose data is a `jax.Array`.

The wrapper lives on the PrivateUse1 device `tpu:0` itself. PyTorch's C++ code
creates tensors "on self's device" (a Python scalar in `torch.where(m, x, 0.0)`,
the mask of attention's math path, `new_zeros`); on `tpu:0` they reach our
allocation kernels and hold data. (An earlier wrapper on `meta` lost them.)
JAX arrays are immutable, so PyTorch's mutable storage is modelled by a
`Storage` box shared by a base tensor and its views: a view keeps the chain of
view ops that produced it, reads recompute from the base when the base changed
since, and writes scatter back into the base (see `views.py`).
"""

from __future__ import annotations

import torch

DEVICE = torch.device("tpu", 0)


class Storage:
    """A mutable box around the base array, shared by all views of it."""

    __slots__ = ("array", "version", "__weakref__")
    lazy_type = None  # set by lazy.py: a pending value makes the storage an output of the next flush
    recorder = None

    def __init__(self, array):
        self.array = array
        self.version = 0
        if type(array) is Storage.lazy_type:
            Storage.recorder.track(self)

    def place(self, array) -> None:
        """Same values, new placement (sharding): views stay valid, so no new version."""
        self.array = array

    def write(self, array) -> None:
        self.array = array
        self.version += 1
        if type(array) is Storage.lazy_type:
            Storage.recorder.track(self)


class TpuTensor(torch.Tensor):
    """A tensor on the `tpu` device; see the module docstring."""

    _storage_box: Storage
    _view_chain: tuple  # ((op, static args), ...) from the base; () for a base
    _cache: object  # the view's value, valid while _cache_version matches
    _cache_version: int

    @staticmethod
    def __new__(cls, array, requires_grad: bool = False, *, storage=None, chain=()):
        global _to_torch_dtype
        if _to_torch_dtype is None:
            from .dtypes import to_torch_dtype as _to_torch_dtype
        shape = tuple(array.shape)
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            dtype=_to_torch_dtype(array.dtype),
            device=DEVICE,
            requires_grad=requires_grad,
        )
        if storage is None:
            storage = Storage(array)
        r._storage_box = storage
        r._view_chain = chain
        r._cache = array
        r._cache_version = storage.version
        return r

    def __init__(self, *args, **kwargs):
        # torch.Tensor.__init__ would complain about our arguments.
        pass

    def tolist(self):
        from .dispatch import to_cpu

        return to_cpu(self).tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(
                "can't convert tpu:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
            )
        from .dispatch import to_cpu

        return to_cpu(self).numpy()

    # --- value --------------------------------------------------------------
    def jax(self):
        """The current `jax.Array` value (recomputed from the base for a stale view)."""
        box = self._storage_box
        if Storage.recorder is not None and Storage.recorder.capture is not None:
            return Storage.recorder.capture.read(self)
        if not self._view_chain:
            return box.array
        cache = self._cache
        if type(cache) is Storage.lazy_type:
            if cache.value is not None:
                self._cache = cache.value
            elif cache.node is None:  # a pending read whose graph ran without it: read again
                self._cache_version = -1
        if self._cache_version != box.version:
            from .views import apply_chain

            self._cache = apply_chain(box.array, self._view_chain)
            self._cache_version = box.version
        return self._cache

    def set_jax(self, value) -> None:
        """Replace this tensor's value in place (a write through a view updates its base)."""
        box = self._storage_box
        if not self._view_chain:
            box.write(value)
        else:
            from .views import scatter_chain

            box.write(scatter_chain(box.array, self._view_chain, value))
        self._cache = value
        self._cache_version = box.version

    def __repr__(self, *, tensor_contents=None):
        from .dispatch import to_cpu

        cpu = to_cpu(self)
        body = repr(cpu)
        if body.endswith(")"):
            extra = f", device='{DEVICE}'"
            if self.requires_grad and "requires_grad" not in body and "grad_fn" not in body:
                extra += ", requires_grad=True"
            if self.grad_fn is not None and "grad_fn" not in body:
                extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
            body = body[:-1] + extra + ")"
        return body

    def __reduce_ex__(self, protocol):
        # Pickling (torch.save) stores the CPU value: a checkpoint loads anywhere.
        from .dispatch import to_cpu

        return to_cpu(self).__reduce_ex__(protocol)

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
        global _dispatch
        if _dispatch is None:
            from .dispatch import dispatch as _dispatch
        return _dispatch(func, args, kwargs or {})


_to_torch_dtype = None
_dispatch = None  # imported on the first op: JAX loads then, not at `import torch`
