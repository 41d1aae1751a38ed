"""`torch.compile` and `torch.tpu.compile` on the tpu device: which program a call becomes.

A step function becomes one program (step_program.py); a module, a forward
program and a backward program joined to autograd (module_program.py).
"""

from __future__ import annotations

import functools

import torch

from .capture import tensor_paths
from .module_program import CompiledModule
from .step_program import CompiledStep
from ..core.tensor import TpuTensor

def compile(fn=None, **options):  # noqa: A001 - mirrors torch.compile
    """Compile a step function or a module for the tpu device."""
    if fn is None:
        return lambda f: compile(f, **options)
    if isinstance(fn, torch.nn.Module):
        # The module is called through its bound `__call__` (its hooks included), not held as a second child:
        # the compiled model's tree, state_dict and named_parameters read as PyTorch's OptimizedModule's, the
        # module under `_orig_mod.` only (checkpoints of a compiled model keep PyTorch's keys).
        return CompiledModule(fn, call=fn.__call__)
    return CompiledStep(fn)


def _reduce(compiled: CompiledModule):
    """`torch.save(compiled_model)`: as PyTorch's OptimizedModule, pickled as the module it compiles and compiled
    again when loaded (its programs are this process's)."""
    return compile, (compiled._orig_mod,)


CompiledModule.__reduce__ = _reduce


def _uses_tpu(fn) -> bool:
    if isinstance(fn, torch.nn.Module):
        return any(isinstance(p, TpuTensor) for p in fn.parameters()) or any(
            isinstance(b, TpuTensor) for b in fn.buffers())
    return False


def patch_torch_compile() -> None:
    """`torch.compile` with the tpu backend named, or no backend and tpu tensors, takes our path."""
    original = torch.compile
    if getattr(original, "_tpu_agent", False):
        return

    def tpu_compile(model=None, *, backend=None, **kwargs):
        if model is None:
            return lambda m: tpu_compile(m, backend=backend, **kwargs)
        if backend == "tpu" or (backend is None and _uses_tpu(model)):
            return compile(model)
        if backend is None and not isinstance(model, torch.nn.Module):
            return _Deferred(model, original, kwargs)
        return original(model, **kwargs) if backend is None else original(model, backend=backend, **kwargs)

    tpu_compile._tpu_agent = True
    tpu_compile.__doc__ = original.__doc__
    torch.compile = tpu_compile


class _Deferred:
    """A function compiled with no backend named: its first call's tensors choose the path."""

    def __init__(self, fn, original, kwargs):
        self._fn, self._original, self._kwargs = fn, original, kwargs
        self._target = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self._target is None:
            on_tpu = bool(tensor_paths((args, kwargs))) or _closure_uses_tpu(self._fn)
            self._target = compile(self._fn) if on_tpu else self._original(self._fn, **self._kwargs)
        return self._target(*args, **kwargs)


def _closure_uses_tpu(fn) -> bool:
    """A step function usually closes over its model and optimizer rather than taking them."""
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_ok(c)]
    values = cells + [v for v in getattr(fn, "__globals__", {}).values() if isinstance(v, torch.nn.Module)]
    return any(_uses_tpu(v) for v in values if isinstance(v, torch.nn.Module))


def _cell_ok(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False

