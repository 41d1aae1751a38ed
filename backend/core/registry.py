"""The registry of op lowerings: one small JAX function per aten op.

A lowering receives the aten op's arguments with every `tpu` tensor replaced by
a `jax.Array` (a tracer under `jax.jit`), Python floats as JAX scalars unless
it asks for them as constants, and everything else (ints, shapes, dtypes) as
plain Python values. It returns what the aten op returns, with arrays in place
of tensors. The dispatcher jit-compiles it once per (op, shapes, dtypes,
static arguments), checks the result's dtype and shape against PyTorch's meta
kernel, and wraps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Lowering:
    fn: Callable
    # Python floats reach the function as constants (one compile per value).
    static_floats: bool = False
    # The function receives `key=` (a jax PRNG key) and must use it for randomness.
    random: bool = False
    # Output shape depends on values (nonzero, unique): run unjitted on concrete arrays.
    jit: bool = True
    # For ops whose output shape depends on values only for some arguments (indexing with a
    # boolean mask): called with the op's arguments, True means run this call unjitted.
    eager_if: Callable | None = None
    # Check results against PyTorch's meta kernel; off where the meta kernel is stricter than
    # the CPU kernel (`_grouped_mm`'s copies CUDA's bf16-only checks).
    meta_check: bool = True


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


def _overloads(op):
    if isinstance(op, torch._ops.OpOverloadPacket):
        # In-place and out= overloads are derived from the functional one by the dispatcher.
        overloads = [getattr(op, name) for name in op.overloads()]
        return [o for o in overloads if not o._schema.is_mutable]
    return [op]


def lower(*ops, static_floats: bool = False, random: bool = False, jit: bool = True, eager_if: Callable | None = None,
          meta_check: bool = True):
    """Register `fn` as the lowering of each op (an overload, or every overload of a packet)."""

    def decorate(fn):
        entry = Lowering(fn, static_floats=static_floats, random=random, jit=jit, eager_if=eager_if,
                         meta_check=meta_check)
        for op in ops:
            for overload in _overloads(op):
                LOWERINGS[overload] = entry
        return fn

    return decorate
