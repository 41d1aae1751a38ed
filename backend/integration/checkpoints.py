"""Checkpoints on tpu as PyTorch makes them on CUDA: `torch.save` tags a tpu tensor's data with its device's
location ("tpu:0"), and `torch.load` restores it there unless `map_location` says otherwise.

Saving: a tpu tensor pickles as its CPU value (tensor.py), so the file is an ordinary PyTorch checkpoint; while
`torch.save` runs, that copy's storage is noted, and a location tagger registered with
`torch.serialization.register_package` (ahead of the CPU's) names its location "tpu:0" instead of "cpu". Plain
PyTorch on a CPU loads such a file with `map_location="cpu"` (or a dict or function mapping "tpu:0"), as it does a
CUDA checkpoint; a function `map_location` sees the "tpu:0" tag.

Loading: PyTorch restores a checkpoint storage by storage onto the mapped device, and a `tpu` tensor has no
PyTorch storage (its value is a `jax.Array`; creating a tpu storage crashes the process). So while `torch.load`
runs, a storage restored to tpu (its saved "tpu" location with no `map_location`, a string, device or dict
`map_location`, or a function calling `storage.tpu()`) stays on the host and is noted; the loaded object's tensors
on noted storages then move to tpu (modules with `.to`). Outside `torch.load`, moving a storage to tpu raises a
clear error instead of crashing.
"""

from __future__ import annotations

import functools
import re
import sys
import threading

import torch

DEVICE_TYPE = "tpu"
_LOADING = threading.local()
_SAVING = threading.local()  # .tags: {storage._cdata: (storage, location)} while torch.save runs
_LOCATION = re.compile(r"tpu(:[0-9]+)?$")
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
        """A storage "on tpu": see `tpu_agent.backend.integration.checkpoints`."""
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


def _note_pickled(value, location: str) -> None:
    """A tpu tensor pickled as `value` (its CPU copy): inside torch.save, its storage's location is `location`."""
    tags = getattr(_SAVING, "tags", None)
    if tags is not None:
        storage = value.untyped_storage()
        tags[storage._cdata] = (storage, location)  # holds the storage: its address is not reused while saving


def _location_tag(storage):
    tags = getattr(_SAVING, "tags", None)
    found = tags.get(storage._cdata) if tags else None
    return found[1] if found is not None else None


def _restore(storage, location: str):
    """A storage saved from tpu (or mapped there) with no other map_location: kept on the host, moved after."""
    if isinstance(location, str) and _LOCATION.match(location):
        return _keep_on_host(storage)
    return None


def _patch_save() -> None:
    original = torch.serialization.save
    if getattr(original, "_tpu_agent", False):
        return

    @functools.wraps(original)
    def save(*args, **kwargs):
        tensor = sys.modules.get(__package__.rpartition(".")[0] + ".core.tensor")
        if tensor is not None and tensor.on_pickle is None:  # no tpu tensor exists before tensor.py is loaded
            tensor.on_pickle = _note_pickled
        outer = getattr(_SAVING, "tags", None)
        _SAVING.tags = {}
        try:
            return original(*args, **kwargs)
        finally:
            _SAVING.tags = outer

    save._tpu_agent = True
    torch.serialization.save = save
    torch.save = save


def register() -> None:
    _patch_storage_moves()
    _patch_load()
    _patch_save()
    if not any(tagger is _location_tag for _, tagger, _ in torch.serialization._package_registry):
        # Ahead of the CPU's tagger (10): the copies a tpu tensor saves as are CPU storages.
        torch.serialization.register_package(9, _location_tag, _restore)
