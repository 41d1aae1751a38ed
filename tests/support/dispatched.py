"""Which aten ops a block of code dispatched: `with Ops() as ops: ...; ops.seen`."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))
