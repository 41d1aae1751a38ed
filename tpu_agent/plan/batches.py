"""Pads batches as they leave the DataLoader, to a few fixed lengths: the `pad_batch` action at run time.

Padding where the loader hands batches over reaches every tensor of the batch
at once (inputs, labels, mask padded by the same amount), before the script
copies it to the device, whatever loop, Trainer or Accelerate drives it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpu_agent.profilers.batches import leaves, map_tensors

_installed = None  # the original __next__, while padding is on


def pad_batch(batch, action):
    """`batch` with the action's tensors padded along its dim to the bucket of the longest of them."""
    dim = action.dim
    sizes = [t.shape[dim] for path, t in leaves(batch) if path in action.values and t.dim() > dim]
    if not sizes:
        return batch
    extra = action.target(max(sizes)) - max(sizes)
    if extra <= 0:
        return batch

    def pad(path: str, t: torch.Tensor) -> torch.Tensor:
        if path not in action.values or t.dim() <= dim:
            return t
        value = action.values[path]
        spec = [0, 0] * (t.dim() - dim - 1) + [0, extra]  # F.pad lists the last dim first
        out = F.pad(t, spec, value=value if t.is_floating_point() else int(value))
        return out.pin_memory() if t.is_pinned() else out

    return map_tensors(batch, pad)


def pad_batches(action) -> None:
    """From now on every DataLoader's batches are padded by `action`."""
    global _installed
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    if _installed is None:
        _installed = cls.__next__
    original = _installed

    def __next__(it):
        return pad_batch(original(it), action)

    cls.__next__ = __next__
