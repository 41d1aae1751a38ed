"""A functional op with a lowering, run: its program built once per signature, then run now or recorded.

The cache key is the op, its arguments' shapes and dtypes, its static arguments, the matmul precision and
the PadOps setting. Building checks the lowering's results against PyTorch's meta kernel (shapes, dtypes,
argument errors as PyTorch words them). In fused mode a jit-able program is recorded into the pending graph
(lazy.py) instead of run; either way the results come back wrapped as tpu tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core import dtypes, modes
from .arguments import DYNAMIC, flatten, signature, template, unflatten
from ..core.launch import launch
from ..core.lazy import DATA_DEPENDENT, RECORDER, Lazy
from .opinfo import OpInfo, info_of
from ..core.programs import new_program
from ..core.registry import Lowering
from ..core.source import user_frame
from ..core.state import RNG, STATE
from ..core.tensor import DEVICE, TpuTensor, wrap

CACHE: dict[tuple, "Entry"] = {}  # op signature -> its program (Entry)


class Entry:
    """An op signature's compiled program, and how its results come back."""

    __slots__ = ("exe", "program", "single")

    def __init__(self, exe, program, single: bool):
        self.exe = exe
        self.program = program
        self.single = single  # one Tensor returned, nothing else: wrapped as is


_EXTRA: dict[tuple, int] = {}  # STATE.cache_key_extra -> a small int (its Precision enum hashes in Python code)
_extra_now: list = [None, 0]  # the setting last seen and its int


def execute(func, lowering: Lowering, args, kwargs, info: OpInfo | None = None, extra: int = 0, raw: bool = False):
    """`extra`: the lowering returns that many values after the schema's results (the new values of arguments
    an op writes though its schema does not say so: opinfo.UNDECLARED_WRITES); they come back as a tuple.
    `raw`: an op that returns one tensor gives its array (or pending value), not a tensor (a value to write)."""
    flat, spec = flatten(args, kwargs)
    key, dynamic, pending = signature(func, lowering, flat)
    key.append(spec)
    if lowering.random:
        base, counter = RNG.next()
        dynamic.append(base)
        dynamic.append(counter)
        if RECORDER.capture is not None:
            RECORDER.capture.note_rng(base, counter)
    setting = STATE.cache_key_extra  # matmul precision, PadOps multiple and sizes
    if setting is not _extra_now[0]:
        _extra_now[0], _extra_now[1] = setting, _EXTRA.setdefault(setting, len(_EXTRA))
    key.append(_extra_now[1])
    jit = lowering.jit and not (lowering.eager_if is not None and lowering.eager_if(*args, **kwargs))
    key.append(jit)  # (`extra` is the op's own: opinfo.UNDECLARED_WRITES, fixed per op, so not in the key)
    key = tuple(key)
    entry = CACHE.get(key)
    if entry is None:
        entry = CACHE[key] = _compile(func, lowering, flat, spec, template(lowering, flat), dynamic, jit, extra)
    recorded = jit and STATE.fused
    try:
        if recorded:
            out = RECORDER.record(entry.program, dynamic)
        else:
            if pending:  # a value still pending in fused mode's graph: computed first
                RECORDER.flush(DATA_DEPENDENT, also=dynamic, op=entry.program.name)
                dynamic = [a.value if type(a) is Lazy else a for a in dynamic]
            out = launch(entry.exe, dynamic)
    except Exception as exc:  # a lowering bug or an invalid argument, named by op
        raise _naming(exc, func) from exc
    if entry.single:
        return out if raw else wrap(out)
    if raw:
        return _wrap_array(out)  # a program run unjitted: its value as a tensor, which a write takes too
    info = info or info_of(func)
    returns = info.returns
    if extra:
        own = _wrap_outputs(func, out[0] if len(returns) == 1 else tuple(out[: len(returns)]))
        return (own if len(returns) > 1 else (own,)) + tuple(_wrap_array(v) for v in out[len(returns):])
    if recorded and info.scalar_results:
        out = _static_scalars(key, func, flat, spec, out, returns)
    return _wrap_outputs(func, out)


_SCALARS: dict[tuple, dict[int, object]] = {}  # op signature -> its scalar results, from the meta kernel


def _static_scalars(key, func, flat, spec, out, returns):
    """A recorded op's int/float/bool results (attention's sequence lengths) are pending like its tensors,
    and a Python number cannot wait: they are shapes' facts, so PyTorch's meta kernel gives them now."""
    scalars = _SCALARS.get(key)
    if scalars is None:
        meta = _meta_outputs(func, flat, spec)
        meta = meta if isinstance(meta, tuple) else (meta,)
        scalars = _SCALARS[key] = {i: meta[i] for i, r in enumerate(returns)
                                   if r in _RETURN_CONVERTERS and isinstance(meta[i], (int, float, bool))}
    if not scalars:
        return out
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    for i, value in scalars.items():
        out[i] = value
    return tuple(out) if len(out) > 1 else out[0]


def _naming(exc: Exception, func) -> Exception:
    """The same error with the aten op's name in front, where its type allows."""
    if str(func) in str(exc):
        return exc
    try:
        return type(exc)(f"{func}: {exc}")
    except Exception:  # an exception type with its own constructor
        exc.add_note(f"(raised by aten op {func} on the tpu device)")
        return exc


def _meta_outputs(func, flat, spec):
    """PyTorch's own shape and dtype rules for this call, from its meta kernel.

    The meta kernel also validates the arguments: its error (mismatched matmul
    shapes, a dim out of range) is the one a PyTorch user expects, so it is
    raised as is. Ops with no meta kernel, or none that runs without data, are
    checked by their lowering alone.
    """

    def to_meta(x):
        if isinstance(x, TpuTensor):
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if isinstance(x, torch.device) and x.type == DEVICE.type:
            return torch.device("meta")
        return x

    args, kwargs = unflatten([to_meta(x) for x in flat], spec)
    try:
        return func(*args, **kwargs)
    except (RuntimeError, IndexError, ValueError) as exc:
        message = str(exc)
        if "meta" in message.lower() or "data-dependent" in message or "NotImplemented" in type(exc).__name__:
            return None
        raise _naming(exc, func) from None
    except Exception:
        return None


def _conform(out, meta, func):
    """Cast a lowering's outputs to the dtypes PyTorch's meta kernel promises."""
    if meta is None:
        return out
    if isinstance(meta, torch.Tensor):
        arr = jnp.asarray(out)
        want = dtypes.to_jax_dtype(meta.dtype)
        if arr.dtype != want:
            arr = arr.astype(want)
        if tuple(arr.shape) != tuple(meta.shape):
            raise RuntimeError(
                f"lowering of {func} returned shape {tuple(arr.shape)}, PyTorch expects {tuple(meta.shape)}"
            )
        return arr
    if isinstance(meta, (list, tuple)) and isinstance(out, (list, tuple)) and len(meta) == len(out):
        return type(out)(_conform(o, m, func) for o, m in zip(out, meta))
    return out


def _compile(func, lowering: Lowering, flat, spec, template, dynamic, jit: bool, extra: int = 0):
    meta = _meta_outputs(func, flat, spec) if jit and lowering.meta_check else None
    fn = lowering.fn
    random = lowering.random
    precision = modes.jax_precision()

    def run(*dynamic):
        if random:
            *dynamic, base, counter = dynamic
        it = iter(dynamic)
        leaves = [next(it) if t is DYNAMIC else t for t in template]
        a, k = unflatten(leaves, spec)
        if random:
            k = dict(k, key=jax.random.fold_in(base, counter))
        with jax.default_matmul_precision(precision):
            out = fn(*a, **k)
        if extra:  # the schema's results conformed, the written arguments' new values as they come
            return tuple(_conform(tuple(out[:-extra]), meta, func)) + tuple(out[-extra:])
        return _conform(out, meta, func)

    exe, program = new_program(str(func), "eager", run, dynamic, jit=jit, source=user_frame())
    returns = info_of(func).returns
    return Entry(exe, program, jit and not extra and len(returns) == 1 and returns[0] == "Tensor")


_RETURN_CONVERTERS = {"bool": bool, "int": int, "float": float, "SymInt": int, "Scalar": lambda x: x.item()}


def _wrap_outputs(func, out):
    returns = info_of(func).returns
    if not returns:
        return None
    if len(returns) == 1:
        return _wrap_one(returns[0], out)
    return tuple(_wrap_one(r, o) for r, o in zip(returns, out))


def _wrap_one(type_name: str, value):
    if type_name in _RETURN_CONVERTERS:
        return _RETURN_CONVERTERS[type_name](value)
    if type_name.startswith("List["):
        return [_wrap_array(v) for v in value]
    return _wrap_array(value)


def _wrap_array(value):
    if value is None:
        return None
    if type(value) is not Lazy and not isinstance(value, jax.Array):
        value = jnp.asarray(value)
    return wrap(value)
