"""Pinned host memory, as a real accelerator backend gives it.

`DataLoader(pin_memory=True)` pins every batch once an accelerator is present, and
PyTorch asks the accelerator's C++ hooks for a pinned allocator, which a Python
backend cannot provide in torch 2.13. `aten::_pin_memory` and `aten::is_pinned` are
CompositeExplicitAutograd, so kernels registered here for the CPU key win for dense
CPU tensors. For a JAX device pinned host memory is plain host memory: the copy
lands in a buffer of ours, whose address counts as pinned until the buffer is freed.
"""

from __future__ import annotations

import torch

_PINNED: set[int] = set()
_library = None


class _PinnedBuffer(bytearray):
    """Host bytes owned by one pinned storage; freeing them unpins the address."""

    def __del__(self):
        _PINNED.discard(getattr(self, "address", None))


def _storage_nbytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return span * t.element_size()


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    """A copy of `self` in pinned host memory, same sizes and strides (as CUDA's kernel)."""
    nbytes = _storage_nbytes(self)
    # One spare itemsize keeps an empty tensor's buffer non-empty (frombuffer refuses b"").
    buffer = _PinnedBuffer(max(nbytes, self.element_size()))
    base = torch.frombuffer(buffer, dtype=torch.uint8)
    storage = base.untyped_storage()
    buffer.address = storage.data_ptr()
    _PINNED.add(buffer.address)
    del base
    out = torch.empty(0, dtype=self.dtype).set_(storage, 0, self.shape, self.stride())
    out.copy_(self)
    return out


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    return self.untyped_storage().data_ptr() in _PINNED


def register() -> None:
    """Install the CPU kernels (once per process)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    _library.impl("_pin_memory", _pin_memory, "CPU")
    _library.impl("is_pinned", _is_pinned, "CPU")

