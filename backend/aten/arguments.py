"""An op's arguments taken apart for its cached program, and put back together inside it.

Flattened (lists and tuples opened), then split into the cache key, the dynamic values the program takes
(device arrays, floats, CPU scalars moved over) and a template of the static rest. A tensor on another
device is refused here, with the op's name.
"""

from __future__ import annotations

import torch

from ..core.lazy import RECORDER, Lazy
from ..core.registry import Lowering
from ..core.tensor import TpuTensor
from ..core.transfer import from_cpu

aten = torch.ops.aten


class _Dynamic:
    """Marks a slot of the flattened arguments that is passed to the compiled function."""


DYNAMIC = _Dynamic()

# Ops that accept CPU index tensors, as on CUDA (Python lists used as indices become CPU tensors).
CPU_ARGS_OK = {aten.index.Tensor, aten.index_put.default}


def signature(func, lowering: Lowering, flat):
    """The cache key and the dynamic values (what the program takes) of flat arguments, and whether one of
    those is pending (fused mode's Lazy, computed before an eager program can take it). On every op: the
    template of the static rest is made on a cache miss only (`template`)."""
    key = [id(func)]  # ops live as long as the process; an OpOverload's __hash__ is Python code
    dynamic = []
    pending = False
    static_floats = lowering.static_floats
    capture = RECORDER.capture
    for x in flat:
        cls = type(x)
        if cls is TpuTensor:
            # A base's array read here, not through x.jax() (a call per tensor); views and captures through it.
            a = x._storage_box.array if capture is None and not x._view_chain else x.jax()
            if type(a) is Lazy:
                if a.value is None:
                    pending = True
                else:
                    a = a.value
            dynamic.append(a)
            key.append(a.shape)
            key.append(a.dtype)
        elif cls is float and not static_floats:
            dynamic.append(x)
            key.append(float)
        elif isinstance(x, torch.Tensor):
            if x.device.type == "cpu" and (x.dim() == 0 or func in CPU_ARGS_OK):
                a = from_cpu(x)
                dynamic.append(a)
                key.append(("cpu", a.shape, a.dtype))
            else:
                raise device_mismatch(func, x, next(i for i, v in enumerate(flat) if v is x))
        else:
            key.append(cls)  # 6 and 6.0 (and True and 1) are equal keys, but not the same op: arange's dtype
            key.append(x)
    return key, dynamic, pending


def template(lowering: Lowering, flat) -> list:
    """The flat arguments with DYNAMIC where `signature` took a dynamic value: the static rest, for the program."""
    static_floats = lowering.static_floats
    return [DYNAMIC if isinstance(x, torch.Tensor) or (type(x) is float and not static_floats) else x for x in flat]


def flatten(args, kwargs):
    """Flat leaves and a hashable structure of an op's arguments (lists and tuples opened).

    A lean stand-in for torch's pytree on the hot path of every op: positional leaves alone
    (most ops) are their own flat list, with their count as the structure. (Module-level
    recursion, not a nested closure: a recursive closure is a reference cycle that keeps
    tensors alive until the garbage collector runs.)
    """
    if not kwargs:
        for a in args:
            if type(a) in (list, tuple):
                break
        else:
            return args, len(args)
    flat: list = []
    spec = (tuple(_walk(a, flat) for a in args), tuple((k, _walk(v, flat)) for k, v in kwargs.items()))
    return flat, spec


def _walk(x, flat):
    if type(x) in (list, tuple):
        return (type(x), tuple(_walk(v, flat) for v in x))
    flat.append(x)
    return None


def unflatten(leaves, spec):
    if type(spec) is int:
        return tuple(leaves), {}
    it = iter(leaves)
    arg_specs, kwarg_specs = spec
    return tuple(_build(a, it) for a in arg_specs), {k: _build(v, it) for k, v in kwarg_specs}


def _build(s, it):
    if s is None:
        return next(it)
    kind, items = s
    return kind(_build(v, it) for v in items)


def device_mismatch(func, tensor, index) -> RuntimeError:
    return RuntimeError(
        f"{func}: expected all tensors to be on the tpu device, but argument {index} is on "
        f"{tensor.device} (shape {list(tensor.shape)}); move it with .to('tpu')"
    )
