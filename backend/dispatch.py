"""Routes every aten op on `tpu` tensors to a JAX lowering.

Order of resolution: a device handler (copies, `.item()`, allocation), then a
view (shares the base's storage), a mutation (run functionally, then written
back), or a functional op: its lowering from the registry, else PyTorch's
decomposition table, else an error that names the op (or, opted in with
`TPU_AGENT_CPU_FALLBACK=1`, a counted run on the CPU).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import dtypes, lazy, modes, ops, padding  # noqa: F401  (ops fills the registry)
from .lazy import RECORDER
from .programs import call_jax, new_program, run_program
from .registry import LOWERINGS, Lowering
from .source import user_frame
from .state import RNG, STATS, cpu_fallback_enabled
from .tensor import DEVICE, TpuTensor, install_dispatcher
from .transfer import from_cpu, materialize, to_cpu
from .views import chain_entry

aten = torch.ops.aten

HANDLERS: dict = {}
FUSE = modes.EagerMode.DEFER_AND_FUSE


def handler(*ops):
    """Register a device handler: it gets the torch-level arguments, not arrays."""

    def decorate(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return decorate


class _Dynamic:
    """Marks a slot of the flattened arguments that is passed to the compiled function."""


DYNAMIC = _Dynamic()


# --------------------------------------------------------------------------
# op classification
# --------------------------------------------------------------------------

FUNCTIONAL, VIEW, MUTATING = "functional", "view", "mutating"


@functools.lru_cache(maxsize=None)
def op_kind(func) -> str:
    schema = func._schema
    if schema.is_mutable:
        return MUTATING
    for ret in schema.returns:
        if ret.alias_info is not None and not ret.alias_info.is_write:
            return VIEW
    return FUNCTIONAL


@functools.lru_cache(maxsize=None)
def functional_variant(func):
    """The functional op a mutating op computes, or None."""
    schema = func._schema
    packet = func.overloadpacket
    name = packet.__name__
    overload = func._overloadname
    candidates = []
    if name.endswith("_") and not name.endswith("__"):
        candidates.append((name[:-1], overload))
    candidates.append((name + "_functional", overload))
    if overload == "out" or overload.endswith("_out"):
        base = overload[: -len("out")].rstrip("_")
        for other in packet.overloads():
            if other == base or (base == "" and other == "default"):
                candidates.append((name, other))
        candidates.append((name, "default"))
    for cand_name, cand_overload in candidates:
        cand_packet = getattr(aten, cand_name, None)
        if cand_packet is None:
            continue
        if cand_overload not in cand_packet.overloads():
            continue
        cand = getattr(cand_packet, cand_overload)
        if cand._schema.is_mutable:
            continue
        if cand is func:
            continue
        if _args_match(schema, cand._schema):
            return cand
    return None


def _args_match(mutating, functional) -> bool:
    names = [a.name for a in mutating.arguments if not (a.alias_info and a.alias_info.is_write) or a.name == "self"]
    cand = [a.name for a in functional.arguments]
    return all(n in cand for n in names if n not in ("out",))


def _written_args(func) -> list[str]:
    return [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


# --------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------


class OpInfo:
    """What dispatch needs to know of one aten op, looked up once: its handler, kind, lowering and
    return types. Keyed by `id(op)` (ops live as long as the process): an OpOverload's own
    `__hash__` is Python code, and a dict lookup by it would run that on every op."""

    __slots__ = ("func", "handler", "kind", "lowering", "returns", "name")

    def __init__(self, func):
        self.func = func
        self.handler = HANDLERS.get(func)
        self.kind = op_kind(func)
        self.lowering = LOWERINGS.get(func)
        self.returns = _return_types(func)
        self.name = str(func)


INFO: dict[int, OpInfo] = {}


def info_of(func) -> OpInfo:
    info = INFO.get(id(func))
    if info is None:
        info = INFO[id(func)] = OpInfo(func)
    return info


def dispatch(func, args, kwargs):
    info = INFO.get(id(func)) or info_of(func)
    if info.handler is not None:
        return info.handler(*args, **kwargs)
    STATS.ops += 1
    kind = info.kind
    if kind is VIEW:
        return run_view(func, args, kwargs)
    if kind is MUTATING:
        return run_mutating(func, args, kwargs)
    if info.lowering is not None:
        return execute(func, info.lowering, args, kwargs, info)
    return run_functional(func, args, kwargs)


def run_functional(func, args, kwargs):
    lowering = LOWERINGS.get(func)
    if lowering is not None:
        return execute(func, lowering, args, kwargs)
    decomposed = decompose(func, args, kwargs)
    if decomposed is not NotImplemented:
        return decomposed
    return unsupported(func, args, kwargs)


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
    return NotImplemented


# --------------------------------------------------------------------------
# functional ops: lower, jit once per signature, run
# --------------------------------------------------------------------------


CACHE: dict[tuple, tuple] = {}  # op signature -> (Executable, Program)
# Ops that accept CPU index tensors, as on CUDA (Python lists used as indices become CPU tensors).
CPU_ARGS_OK = {aten.index.Tensor, aten.index_put.default}


def _signature(func, lowering: Lowering, flat):
    """Split flat arguments into the cache key, the dynamic values and a template."""
    key = [id(func)]  # ops live as long as the process; an OpOverload's __hash__ is Python code
    dynamic = []
    template = []
    static_floats = lowering.static_floats
    for i, x in enumerate(flat):
        cls = type(x)
        if cls is TpuTensor:
            a = x.jax()
            dynamic.append(a)
            key.append(a.shape)
            key.append(a.dtype)
            template.append(DYNAMIC)
        elif cls is float and not static_floats:
            dynamic.append(x)
            key.append(float)
            template.append(DYNAMIC)
        elif isinstance(x, torch.Tensor):
            if x.device.type == "cpu" and (x.dim() == 0 or func in CPU_ARGS_OK):
                a = from_cpu(x)
                dynamic.append(a)
                key.append(("cpu", a.shape, a.dtype))
                template.append(DYNAMIC)
            else:
                raise device_mismatch(func, x, i)
        else:
            key.append(x)
            template.append(x)
    return key, dynamic, template


def _flatten(args, kwargs):
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


def _unflatten(leaves, spec):
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


def execute(func, lowering: Lowering, args, kwargs, info: OpInfo | None = None):
    flat, spec = _flatten(args, kwargs)
    key, dynamic, template = _signature(func, lowering, flat)
    key.append(spec)
    if lowering.random:
        base, counter = RNG.next()
        dynamic.append(base)
        dynamic.append(counter)
        if RECORDER.capture is not None:
            RECORDER.capture.note_rng(base, counter)
    key.append(modes._precision)
    key.append(padding._multiple)
    key.append(padding._sizes)
    jit = lowering.jit and not (lowering.eager_if is not None and lowering.eager_if(*args, **kwargs))
    key.append(jit)
    key = tuple(key)
    entry = CACHE.get(key)
    if entry is None:
        entry = CACHE[key] = _compile(func, lowering, flat, spec, template, dynamic, jit)
    try:
        if jit and modes._mode is FUSE and not modes._eager_override:
            out = RECORDER.record(entry[1], dynamic)
        else:
            out = run_program(*entry, dynamic, jit=jit)
    except Exception as exc:  # a lowering bug or an invalid argument, named by op
        raise _naming(exc, func) from exc
    returns = (info or info_of(func)).returns
    if len(returns) == 1 and returns[0] == "Tensor":
        return _wrap_array(out)
    return _wrap_outputs(func, out)


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

    args, kwargs = _unflatten([to_meta(x) for x in flat], spec)
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


def _compile(func, lowering: Lowering, flat, spec, template, dynamic, jit: bool):
    meta = _meta_outputs(func, flat, spec) if jit and lowering.meta_check else None
    fn = lowering.fn
    random = lowering.random
    precision = modes.jax_precision()

    def run(*dynamic):
        if random:
            *dynamic, base, counter = dynamic
        it = iter(dynamic)
        leaves = [next(it) if t is DYNAMIC else t for t in template]
        a, k = _unflatten(leaves, spec)
        if random:
            k = dict(k, key=jax.random.fold_in(base, counter))
        with jax.default_matmul_precision(precision):
            out = fn(*a, **k)
        return _conform(out, meta, func)

    return new_program(str(func), "eager", run, dynamic, jit=jit, source=user_frame())


_RETURN_CONVERTERS = {"bool": bool, "int": int, "float": float, "SymInt": int, "Scalar": lambda x: x.item()}


@functools.lru_cache(maxsize=None)
def _return_types(func) -> tuple[str, ...]:
    return tuple(str(r.type) for r in func._schema.returns)


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
    if type(value) is not lazy.Lazy and not isinstance(value, jax.Array):
        value = jnp.asarray(value)
    return TpuTensor(value)


# --------------------------------------------------------------------------
# views and mutations
# --------------------------------------------------------------------------


# Views that are the same array: they share the source's storage and chain, no op runs.
ALIAS_OPS = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}


def run_view(func, args, kwargs):
    if func in ALIAS_OPS:
        source = args[0]
        return TpuTensor(source.jax(), storage=source._storage_box, chain=source._view_chain)
    lowering = LOWERINGS.get(func)
    if lowering is None:
        decomposed = decompose(func, args, kwargs)
        if decomposed is not NotImplemented:
            return decomposed
        return unsupported(func, args, kwargs)
    source = args[0] if args else kwargs.get("self")
    if _index_view_of_concrete(func, source):
        # A batch sliced from a dataset tensor: computed now, so fused graphs take it as an
        # input instead of baking the index in (one graph for every batch, not one per index).
        with modes.eager_override():
            out = execute(func, lowering, args, kwargs)
    else:
        out = execute(func, lowering, args, kwargs)
    if not isinstance(source, TpuTensor):
        return out
    outs = out if isinstance(out, (list, tuple)) else [out]
    for index, view in enumerate(outs):
        entry = chain_entry(func, args, kwargs, index if isinstance(out, (list, tuple)) else None)
        view._storage_box = source._storage_box
        view._view_chain = source._view_chain + (entry,)
        view._cache_version = source._storage_box.version
    return out


INDEX_VIEWS = {aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.unbind.int,
               aten.split.Tensor, aten.split_with_sizes.default, aten.diagonal.default}


def _index_view_of_concrete(func, source) -> bool:
    if func not in INDEX_VIEWS or not modes.fused() or RECORDER.capture is not None:
        return False
    return isinstance(source, TpuTensor) and type(source.jax()) is not lazy.Lazy


def _metadata_inplace_ops():
    pairs = {"t_": "t", "transpose_": "transpose", "squeeze_": "squeeze", "unsqueeze_": "unsqueeze",
             "swapdims_": "transpose", "swapaxes_": "transpose", "as_strided_": "as_strided"}
    table = {}
    for inplace, view in pairs.items():
        packet, view_packet = getattr(aten, inplace), getattr(aten, view)
        for name in packet.overloads():
            target = name if name in view_packet.overloads() else ("int" if "int" in view_packet.overloads() else "default")
            table[getattr(packet, name)] = getattr(view_packet, target)
    return table


METADATA_INPLACE = _metadata_inplace_ops()


def run_metadata_inplace(func, args, kwargs):
    """`t_`, `squeeze_`...: the tensor becomes a view of its own storage with a new shape.

    Our wrapper's shape lives on its C++ (meta) side: the op runs there with our dispatch
    off to update it, and the tensor's view chain gains the matching view op.
    """
    self = args[0]
    view = run_view(METADATA_INPLACE[func], args, kwargs)
    with torch._C._DisableTorchDispatch():
        func(*args, **kwargs)
    self._view_chain, self._cache, self._cache_version = view._view_chain, view._cache, view._cache_version
    return self


def run_mutating(func, args, kwargs):
    if func in METADATA_INPLACE:
        return run_metadata_inplace(func, args, kwargs)
    if func in LOWERINGS:
        return _run_mutating_lowering(func, args, kwargs)
    functional = functional_variant(func)
    if functional is None:
        decomposed = decompose(func, args, kwargs)
        if decomposed is not NotImplemented:
            return decomposed
        return unsupported(func, args, kwargs)
    written = _written_args(func)
    bound = _bind(func, args, kwargs)
    fargs, fkwargs = _functional_call_args(func, functional, bound)
    result = dispatch(functional, fargs, fkwargs)
    results = list(result) if isinstance(result, (list, tuple)) and not _is_list_return(functional) else [result]
    n_returns = len(functional._schema.returns)
    # Conventions: `foo_` returns the new self; `foo_functional` returns outputs then new
    # values of the written arguments; `foo.out` returns the outputs written into `out`.
    targets = [bound[name] for name in written]
    if func.overloadpacket.__name__.endswith("_") or _is_out(func):
        values = results[: len(targets)] if len(targets) > 1 else [result]
    else:
        values = results[n_returns - len(targets):]
    for target, value in zip(targets, values):
        _write(func, target, value)
    if not func._schema.returns:
        return None
    if func.overloadpacket.__name__.endswith("_") or _is_out(func):
        # What the schema returns: `_amp_update_scale_` writes two arguments, returns one.
        n = len(func._schema.returns)
        return targets[0] if n == 1 else tuple(targets[:n])
    # An op that updates some arguments and returns other things (batch norm's running
    # statistics): its own outputs lead the functional variant's.
    own = results[: len(func._schema.returns)]
    return own[0] if len(own) == 1 else tuple(own)


def _run_mutating_lowering(func, args, kwargs):
    """A lowering registered directly on a mutating op returns the new values of written args."""
    written = _written_args(func)
    bound = _bind(func, args, kwargs)
    new_values = execute(func, LOWERINGS[func], args, kwargs)
    if len(written) == 1:
        new_values = [new_values]
    for name, value in zip(written, new_values):
        _write(func, bound[name], value)
    return bound[written[0]] if len(written) == 1 else tuple(bound[n] for n in written)


def _is_out(func) -> bool:
    return any(a.is_out for a in func._schema.arguments)


def _is_list_return(func) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and str(returns[0].type).startswith("List[")


def _bind(func, args, kwargs) -> dict:
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _functional_call_args(func, functional, bound):
    args, kwargs = [], {}
    for arg in functional._schema.arguments:
        if arg.name not in bound:
            continue
        if arg.kwarg_only:
            kwargs[arg.name] = bound[arg.name]
        else:
            args.append(bound[arg.name])
    return tuple(args), kwargs


def _write(func, target, value) -> None:
    if isinstance(target, (list, tuple)):
        for t, v in zip(target, value):
            _write(func, t, v)
        return
    if target is None:
        return
    if not isinstance(target, TpuTensor):
        if isinstance(target, torch.Tensor):
            raise device_mismatch(func, target, 0)
        return
    array = value.jax() if isinstance(value, TpuTensor) else value
    if not isinstance(array, (jax.Array, lazy.Lazy)):
        array = jnp.asarray(array)
    want = dtypes.to_jax_dtype(target.dtype)
    if tuple(array.shape) != tuple(target.shape):
        if array.size == 0 or target.numel() == 0 or tuple(target.shape) != jnp.broadcast_shapes(array.shape, target.shape):
            raise RuntimeError(
                f"{func}: cannot write a result of shape {tuple(array.shape)} into a tpu tensor of shape "
                f"{tuple(target.shape)} (resizing tpu tensors in place is not supported)"
            )
        array = _broadcast_cast(array, tuple(target.shape), want)
    elif array.dtype != want:
        array = _cast(array, want)
    target.set_jax(array)


def _cast(array, dtype):
    want = jnp.dtype(dtype)
    return call_jax(("cast", array.shape, str(array.dtype), str(want)), "cast", lambda a: a.astype(want), array)


def _broadcast_cast(array, shape, dtype):
    want = jnp.dtype(dtype)
    key = ("broadcast_cast", array.shape, str(array.dtype), shape, str(want))
    return call_jax(key, "broadcast_cast", lambda a: jnp.broadcast_to(a, shape).astype(want), array)


# --------------------------------------------------------------------------
# errors and the CPU fallback
# --------------------------------------------------------------------------


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.device.type}:{list(x.shape)}:{str(x.dtype).replace('torch.', '')}"
    return repr(x)


def device_mismatch(func, tensor, index) -> RuntimeError:
    return RuntimeError(
        f"{func}: expected all tensors to be on the tpu device, but argument {index} is on "
        f"{tensor.device} (shape {list(tensor.shape)}); move it with .to('tpu')"
    )


def unsupported(func, args, kwargs):
    if cpu_fallback_enabled():
        return cpu_fallback(func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    shapes = ", ".join(_describe(x) for x in flat if isinstance(x, torch.Tensor))
    label = "aten op" if func.namespace == "aten" else "op"
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
        bound = _bind(func, args, kwargs)
        for name in _written_args(func):
            target = bound[name]
            targets = target if isinstance(target, (list, tuple)) else [target]
            for t in targets:
                if isinstance(t, TpuTensor):
                    t.set_jax(from_cpu(moved[id(t)]))
    return tree_map(lambda x: TpuTensor(from_cpu(x)) if isinstance(x, torch.Tensor) else x, out)


# --------------------------------------------------------------------------
# device handlers
# --------------------------------------------------------------------------


@handler(torch.ops.prim.device.default)
def _device(x):
    return DEVICE


@handler(aten._local_scalar_dense.default)
def _item(x):
    value = materialize(x, "Tensor.item()")
    STATS.d2h_count += 1
    STATS.d2h_bytes += value.dtype.itemsize * value.size
    return jax.device_get(value).item()


@handler(aten.is_pinned.default)
def _is_pinned(x, device=None):
    return False


@handler(aten._to_copy.default)
def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    target = torch.device(device) if device is not None else DEVICE
    if target.type == "cpu":
        out = to_cpu(x)
        return out.to(dtype) if dtype is not None else out
    if target.type != DEVICE.type:
        raise RuntimeError(f"aten._to_copy: cannot move a tpu tensor to {target}")
    if not isinstance(x, TpuTensor):
        x = TpuTensor(from_cpu(x))
        if dtype is None or dtype == x.dtype:
            return x
    want = dtypes.to_jax_dtype(dtype) if dtype is not None else x.jax().dtype
    return TpuTensor(_cast(x.jax(), want))


@handler(aten.copy_.default)
def _copy_(dst, src, non_blocking=False):
    return copy_into(dst, src)


def copy_into(dst, src):
    """`dst.copy_(src)` where either side is on the device."""
    if isinstance(dst, TpuTensor):
        value = src.jax() if isinstance(src, TpuTensor) else from_cpu(src)
        if tuple(value.shape) != tuple(dst.shape):  # copy_ broadcasts src to dst, an empty dst included
            value = _broadcast_cast(value, tuple(dst.shape), dtypes.to_jax_dtype(dst.dtype))
        _write(aten.copy_.default, dst, value)
        return dst
    # CPU destination, tpu source.
    dst.copy_(to_cpu(src))
    return dst


def _enable_foreach_optimizers() -> None:
    """Optimizers pick their multi-tensor path only for listed tensor types; a C++
    backend's tensors are plain `torch.Tensor`, ours a subclass, so list it."""
    import torch.optim.optimizer as optimizer_module

    supported = getattr(optimizer_module, "_foreach_supported_types", None)
    if isinstance(supported, list) and TpuTensor not in supported:
        supported.append(TpuTensor)


_enable_foreach_optimizers()  # here, on the first op: `import torch` must not load JAX
install_dispatcher(dispatch)  # every op on a TpuTensor comes here from now on
