"""An op with no lowering: PyTorch's decomposition of it, else an error that names the op and its arguments,
or (opted in with `TPU_AGENT_CPU_FALLBACK=1`) a run on the CPU, counted in the profile's fallbacks."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .opinfo import MUTATING, bind, op_kind, written_args
from ..core.state import STATS, cpu_fallback_enabled
from ..core.tensor import TpuTensor
from ..core.transfer import from_cpu, to_cpu


@functools.lru_cache(maxsize=None)
def _decomposition(func) -> Callable | None:
    from torch._decomp import decomposition_table

    return decomposition_table.get(func)


def decompose(func, args, kwargs):
    decomp = _decomposition(func)
    if decomp is not None:
        return decomp(*args, **kwargs)
    if func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return func.decompose(*args, **kwargs)
    if func.namespace not in _OWN_NAMESPACES and func.has_kernel_for_dispatch_key(_PRIVATE_USE1):
        # A library's own op with a kernel for devices like ours (FSDP2's fsdp.all_gather_copy_in,
        # split_with_sizes_copy, chunk_cat): that kernel, written in torch ops, runs them here.
        return func._op_dk(_PRIVATE_USE1, *args, **kwargs)
    if func.namespace not in _OWN_NAMESPACES and func.has_kernel_for_dispatch_key(_EXPLICIT):
        # A custom op whose one kernel is for every device (torch.library.custom_op without device_types:
        # varlen_attn's torch_attn._varlen_attn): that kernel, in aten ops we lower.
        return func._op_dk(_EXPLICIT, *args, **kwargs)
    return NotImplemented


_OWN_NAMESPACES = ("aten", "prims", "c10d", "_c10d_functional")
_PRIVATE_USE1 = torch._C.DispatchKey.PrivateUse1
_EXPLICIT = torch._C.DispatchKey.CompositeExplicitAutograd


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.device.type}:{list(x.shape)}:{str(x.dtype).replace('torch.', '')}"
    return repr(x)


def unsupported(func, args, kwargs):
    if cpu_fallback_enabled():
        return cpu_fallback(func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    shapes = ", ".join(_describe(x) for x in flat if isinstance(x, torch.Tensor))
    label = "aten op" if func.namespace == "aten" else "op"
    if func.namespace == "c10d":  # PyTorch routes a group's collectives here when its backend has no tpu one
        raise RuntimeError(f"{func} on tpu tensors ({shapes}): the process group has no tpu backend; start it "
                           "with init_process_group() with no backend, 'tpu' or 'cpu:gloo,tpu:tpu'")
    raise NotImplementedError(
        f"{label} {func} is not supported on the tpu device (arguments: {shapes}); "
        "set TPU_AGENT_CPU_FALLBACK=1 to run it on the CPU"
    )


def cpu_fallback(func, args, kwargs):
    STATS.fallbacks[str(func)] += 1
    moved = {}

    def to_host(x):
        if isinstance(x, TpuTensor):
            moved[id(x)] = to_cpu(x)
            return moved[id(x)]
        return x

    cargs, ckwargs = tree_map(to_host, (args, kwargs))
    out = func(*cargs, **ckwargs)
    if op_kind(func) is MUTATING:
        bound = bind(func, args, kwargs)
        for name in written_args(func):
            target = bound[name]
            targets = target if isinstance(target, (list, tuple)) else [target]
            for t in targets:
                if isinstance(t, TpuTensor):
                    t.set_jax(from_cpu(moved[id(t)]))
    return tree_map(lambda x: TpuTensor(from_cpu(x)) if isinstance(x, torch.Tensor) else x, out)
