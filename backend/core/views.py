"""Views over immutable arrays: replay the view chain to read, scatter to write.

A view records the chain of view ops from its base. Reading a view whose base
changed replays the chain on the base; writing a view maps it to positions of
the base by replaying the chain on an index array (`arange` over the base),
then scatters. Both are jit-compiled once per (chain, shapes).
"""

from __future__ import annotations

import jax.numpy as jnp

from .programs import call_jax
from .registry import LOWERINGS


def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x


def chain_entry(func, args, kwargs, index):
    """One link of a view chain: the op, its non-tensor arguments, which output."""
    return (func, _freeze(args[1:]), _freeze(kwargs), index)


def _replay(array, chain):
    for func, args, kwargs, index in chain:
        out = LOWERINGS[func].fn(array, *args, **dict(kwargs))
        array = out[index] if index is not None else out
    return array


def _read(chain):
    return lambda base: _replay(base, chain)


def _write(chain):
    def write(base, value):
        positions = _replay(jnp.arange(base.size).reshape(base.shape), chain)
        value = jnp.broadcast_to(value, positions.shape).astype(base.dtype)
        flat = base.reshape(-1).at[positions.reshape(-1)].set(value.reshape(-1))
        return flat.reshape(base.shape)

    return write


def _aval(x):
    return (tuple(x.shape), str(x.dtype))


def apply_chain(base, chain):
    return call_jax(("view_read", chain, _aval(base)), "view_read", _read(chain), base)


def scatter_chain(base, chain, value):
    return call_jax(("view_write", chain, _aval(base), _aval(value)), "view_write", _write(chain), base, value)
