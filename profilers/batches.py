"""The batches a script's DataLoaders yield, seen as they leave the loader.

On an XLA device a batch length that changes from batch to batch is a new
program to compile each time. The lengths are made in the collate function
(`pad_sequence`, a tokenizer's `padding="longest"`, `DataCollatorWithPadding`),
so that is where they are watched: every tensor of every batch by its path
(`['input_ids']`, `[0]`), its shape, and what fills its last position in the
rows that were padded (the pad value a fix must use).

The same walk rebuilds a batch with some tensors replaced (`map_tensors`):
the bucketing plan pads batches where they leave the loader.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

MAX_BATCHES = 2000  # a long run keeps its first batches' shapes, not an unbounded list
MASK_KEYS = ("attention_mask",)  # a row whose mask ends in 0 was padded


def leaves(batch, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a batch of dicts, tuples and lists."""
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in leaves(v, f"{path}[{k!r}]")]
    if isinstance(batch, (tuple, list)):
        return [leaf for i, v in enumerate(batch) for leaf in leaves(v, f"{path}[{i}]")]
    return []


def map_tensors(batch, fn: Callable[[str, torch.Tensor], torch.Tensor], path: str = ""):
    """The batch with every tensor replaced by fn(path, tensor), its containers' types kept."""
    if isinstance(batch, torch.Tensor):
        return fn(path, batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn, f"{path}[{k!r}]") for k, v in batch.items()}
        if type(batch) is dict:
            return items
        try:
            out = type(batch)(items)  # transformers' BatchEncoding, an OrderedDict...
        except Exception:  # noqa: BLE001 - a mapping that cannot be rebuilt from a dict
            return items
        return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(batch)))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(batch))
    return batch


def describe_collate(collate) -> str:
    """What made the batches, for a user: a function of theirs by file:line, a collator by its settings."""
    if collate is None:
        return "no collate function (batches come from the dataset as they are)"
    code = getattr(collate, "__code__", None)
    name = getattr(collate, "__qualname__", None) or type(collate).__name__
    if code is not None:
        if name == "default_collate":
            return "default_collate (stacks the dataset's items: their lengths must differ)"
        return f"{name} at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    settings = {k: getattr(collate, k) for k in ("padding", "pad_to_multiple_of", "max_length")
                if hasattr(collate, k)}
    shown = ", ".join(f"{k}={v!r}" for k, v in settings.items())
    return f"{type(collate).__name__}({shown})"


@dataclass
class Seen:
    """One tensor of the batches: its shape at each batch, and the values ending its padded rows."""

    shapes: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (step, shape)
    tail_values: Counter = field(default_factory=Counter)  # value at [:, -1] of rows that were padded
    dtype: str = ""


class BatchWatch:
    """Records every batch a DataLoader yields while installed. `step()` says which step a batch belongs to."""

    def __init__(self, step: Callable[[], int]):
        self.step = step
        self.tensors: dict[str, Seen] = {}
        self.collates: list[str] = []
        self.batches = 0
        self._original = None

    def install(self) -> None:
        from torch.utils.data import dataloader

        cls = dataloader._BaseDataLoaderIter
        original = self._original = cls.__next__
        watch = self

        def __next__(it):
            batch = original(it)
            try:
                watch.see(batch, getattr(it, "_collate_fn", None))
            except Exception:  # noqa: BLE001 - watching never breaks the user's loader
                pass
            return batch

        cls.__next__ = __next__

    def uninstall(self) -> None:
        if self._original is not None:
            from torch.utils.data import dataloader

            dataloader._BaseDataLoaderIter.__next__ = self._original
            self._original = None

    def see(self, batch, collate=None) -> None:
        self.batches += 1
        if self.batches > MAX_BATCHES:
            return
        what = describe_collate(collate)
        if what not in self.collates:
            self.collates.append(what)
        found = leaves(batch)
        padded_rows = _padded_rows(found)
        step = self.step()
        for path, t in found:
            seen = self.tensors.setdefault(path, Seen(dtype=str(t.dtype).replace("torch.", "")))
            seen.shapes.append((step, tuple(t.shape)))
            if t.dim() >= 2 and t.shape[1] > 0 and not t.is_floating_point() and not t.is_complex():
                last = t[:, -1] if padded_rows is None or padded_rows.shape[0] != t.shape[0] else t[padded_rows, -1]
                seen.tail_values.update(last[:64].tolist())


def _padded_rows(found: list[tuple[str, torch.Tensor]]):
    """The rows an attention mask marks as padded at their end, when the batch has one."""
    for path, t in found:
        if path.endswith(tuple(f"[{k!r}]" for k in MASK_KEYS)) and t.dim() == 2 and t.shape[1] > 0:
            return t[:, -1] == 0
    return None
