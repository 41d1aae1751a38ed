"""`torch.load(..., map_location=<tpu>)`: storages restored on the host, tensors moved after.

PyTorch restores a checkpoint storage by storage onto the mapped device, and a `tpu`
tensor has no PyTorch storage (its value is a `jax.Array`; creating a tpu storage
crashes the process). So while `torch.load` runs, a storage sent to tpu (a string,
device or dict `map_location`, or a function calling `storage.tpu()`) stays on the host
and is noted; the loaded object's tensors on noted storages then move to tpu. Outside
`torch.load`, moving a storage to tpu raises a clear error instead of crashing.
"""

from __future__ import annotations

import functools
import threading

import torch

DEVICE_TYPE = "tpu"
_LOADING = threading.local()
_NO_STORAGES = (
    "the bundled tpu device has no PyTorch storages (its tensors hold jax.Arrays): "
    "move tensors with tensor.to('tpu'), or load checkpoints with torch.load(..., map_location='tpu')"
)


def _is_tpu(device) -> bool:
    if isinstance(device, int):
        return False
    return torch.device(device).type == DEVICE_TYPE


def _keep_on_host(storage):
    """Inside `torch.load`: the storage stays on the host, noted for a move after loading."""
    noted = getattr(_LOADING, "noted", None)
    if noted is None:
        raise RuntimeError(_NO_STORAGES)
    noted.add(storage.data_ptr())
    return storage


def _patch_storage_moves() -> None:
    base = torch.storage._StorageBase
    original_to = base.to
    if getattr(original_to, "_tpu_agent", False):
        return

    @functools.wraps(original_to)
    def to(self, *, device, non_blocking=False):
        if _is_tpu(device):
            return _keep_on_host(self)
        return original_to(self, device=device, non_blocking=non_blocking)

    def tpu(self, device=None, non_blocking=False):
        """A storage "on tpu": see `tpu_agent.backend.checkpoints`."""
        return _keep_on_host(self)

    to._tpu_agent = True
    base.to = to
    base.tpu = tpu


def _move(obj, noted: set, memo: dict):
    """`obj` with every tensor on a noted host storage moved to tpu (shared objects stay shared)."""
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.Tensor):
        if _noted(obj, noted):
            moved = obj.detach().to(DEVICE_TYPE)
            if isinstance(obj, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=obj.requires_grad)
            else:
                moved.requires_grad_(obj.requires_grad)
        else:
            moved = obj
    elif isinstance(obj, torch.nn.Module):
        moved = obj.to(DEVICE_TYPE) if any(_noted(t, noted) for t in obj.state_dict().values()) else obj
    elif isinstance(obj, dict):
        moved = obj.copy()  # keeps OrderedDict and a state dict's `_metadata`
        for k, v in obj.items():
            moved[k] = _move(v, noted, memo)
    elif isinstance(obj, list):
        moved = [_move(v, noted, memo) for v in obj]
    elif isinstance(obj, tuple):
        items = [_move(v, noted, memo) for v in obj]
        moved = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        moved = obj
    memo[key] = moved
    return moved


def _noted(t, noted) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() in noted


def _patch_load() -> None:
    original = torch.serialization.load
    if getattr(original, "_tpu_agent", False):
        return

    @functools.wraps(original)
    def load(*args, **kwargs):
        outer = getattr(_LOADING, "noted", None)
        _LOADING.noted = noted = set()
        try:
            result = original(*args, **kwargs)
        finally:
            _LOADING.noted = outer
        return _move(result, noted, {}) if noted else result

    load._tpu_agent = True
    torch.serialization.load = load
    torch.load = load


def register() -> None:
    _patch_storage_moves()
    _patch_load()
