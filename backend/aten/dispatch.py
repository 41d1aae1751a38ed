"""Routes every aten op on `tpu` tensors to the code that runs it: the device's one entry point.

Order of resolution: a device handler (handlers.py: copies, `.item()`, allocation), then a view
(view_ops.py: shares the base's storage), a mutation (run as its functional op, then written back:
writes.py), or a functional op: its lowering (execute.py), else PyTorch's decomposition table, else an
error that names the op (or, opted in with `TPU_AGENT_CPU_FALLBACK=1`, a counted run on the CPU:
fallback.py). The first op imports this module (device.py's kernels do): importing it fills the handler
and lowering tables, lists TpuTensor for the optimizers' foreach path and makes `dispatch` TpuTensor's
entry point (tensor.py cannot import it: this module builds tensors of that class).
"""

from __future__ import annotations

from . import handlers  # noqa: F401  (they fill the handler and lowering tables)
from .. import ops  # noqa: F401  (they fill the handler and lowering tables)
from .execute import execute
from .fallback import decompose, unsupported
from .handlers import copy_into  # noqa: F401  (device.py's copy kernel)
from .opinfo import (
    FUNCTIONAL,
    INFO,
    MUTATING,
    UNDECLARED_WRITES,
    VIEW,
    bind,
    functional_variant,
    info_of,
    is_list_return,
    is_out,
    written_args)
from ..core.registry import LOWERINGS
from ..core.state import STATS
from ..core.tensor import TpuTensor, install_dispatcher
from .view_ops import METADATA_INPLACE, run_metadata_inplace, run_view
from .writes import write


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


class _Mutation:
    """What running one mutating op through its functional variant needs, read from the two schemas once (a
    schema's arguments are a list built by pybind at every read): the functional op, the mutating op's arguments
    (name, default) in order, the functional's (name, kwarg-only), the written arguments and the conventions."""

    __slots__ = ("functional", "arguments", "functional_arguments", "written", "in_place", "n_returns",
                 "list_return", "own_returns", "fast")

    def __init__(self, func, functional):
        self.functional = functional
        self.arguments = tuple((a.name, a.default_value if a.has_default_value() else _NO_DEFAULT)
                               for a in func._schema.arguments)
        self.functional_arguments = tuple((a.name, a.kwarg_only) for a in functional._schema.arguments)
        self.written = tuple(written_args(func))
        # Conventions: `foo_` returns the new self; `foo_functional` returns outputs then new values of the
        # written arguments; `foo.out` returns the outputs written into `out`.
        self.in_place = func.overloadpacket.__name__.endswith("_") or is_out(func)
        self.n_returns = len(functional._schema.returns)
        self.list_return = is_list_return(functional)
        self.own_returns = len(func._schema.returns)
        info = info_of(functional)
        # `self.foo_(...)` whose functional `foo` has a lowering and returns one tensor: its new value is written
        # as an array, with no tensor made for it in between.
        self.fast = (self.in_place and self.written == ("self",) and self.own_returns == 1 and info.handler is None
                     and info.kind is FUNCTIONAL and info.lowering is not None and info.returns == ("Tensor",))

    def bind(self, args, kwargs) -> dict:
        """opinfo.bind's result, from the arguments read once."""
        bound = {}
        n = len(args)
        for i, (name, default) in enumerate(self.arguments):
            if i < n:
                bound[name] = args[i]
            elif name in kwargs:
                bound[name] = kwargs[name]
            elif default is not _NO_DEFAULT:
                bound[name] = default
        return bound

    def call_args(self, bound):
        """opinfo.functional_call_args's result, from the arguments read once."""
        args, kwargs = [], {}
        for name, kwarg_only in self.functional_arguments:
            if name in bound:
                if kwarg_only:
                    kwargs[name] = bound[name]
                else:
                    args.append(bound[name])
        return tuple(args), kwargs


_NO_DEFAULT = object()
_MUTATIONS: dict[int, object] = {}  # id(op) -> its _Mutation, or how else it runs (a function below)


def run_mutating(func, args, kwargs):
    """A mutating op: its own lowering, else its functional variant dispatched (it may be a handler's or
    a decomposition's) and the new values written into the written arguments."""
    plan = _MUTATIONS.get(id(func))
    if plan is None:
        plan = _MUTATIONS[id(func)] = _mutation_plan(func)
    if type(plan) is not _Mutation:
        return plan(func, args, kwargs)
    bound = plan.bind(args, kwargs)
    fargs, fkwargs = plan.call_args(bound)
    functional = plan.functional
    if plan.fast:
        target = bound["self"]
        STATS.ops += 1  # counted as dispatch counts the functional op
        value = execute(functional, info_of(functional).lowering, fargs, fkwargs, raw=True)
        if type(target) is TpuTensor and not target._view_chain and _same_aval(value, target._storage_box):
            target.set_jax(value)  # what write() does when no cast and no broadcast is needed
        else:
            write(func, target, value)
        return target
    result = dispatch(functional, fargs, fkwargs)
    results = list(result) if isinstance(result, (list, tuple)) and not plan.list_return else [result]
    targets = [bound[name] for name in plan.written]
    if plan.in_place:
        values = results[: len(targets)] if len(targets) > 1 else [result]
    else:
        values = results[plan.n_returns - len(targets):]
    for target, value in zip(targets, values):
        write(func, target, value)
    if not plan.own_returns:
        return None
    if plan.in_place:
        # What the schema returns: `_amp_update_scale_` writes two arguments, returns one.
        n = plan.own_returns
        return targets[0] if n == 1 else tuple(targets[:n])
    # An op that updates some arguments and returns other things (batch norm's running
    # statistics): its own outputs lead the functional variant's.
    own = results[: plan.own_returns]
    return own[0] if len(own) == 1 else tuple(own)


def _same_aval(value, box) -> bool:
    """A new value that fits a base's storage as it is: same shape and dtype, the storage not freed."""
    array = box.array
    return box.freed is None and value.shape == array.shape and value.dtype == array.dtype


def _mutation_plan(func):
    if func in METADATA_INPLACE:
        return run_metadata_inplace
    if func in UNDECLARED_WRITES:
        return run_undeclared
    if func in LOWERINGS:
        return _run_mutating_lowering
    functional = functional_variant(func)
    if functional is None:
        return _decomposed_or_unsupported
    return _Mutation(func, functional)


def _decomposed_or_unsupported(func, args, kwargs):
    decomposed = decompose(func, args, kwargs)
    if decomposed is not NotImplemented:
        return decomposed
    return unsupported(func, args, kwargs)


def run_undeclared(func, args, kwargs):
    """An op that writes arguments its schema does not mark (native_batch_norm's running statistics, see
    opinfo.UNDECLARED_WRITES): its lowering returns the schema's results, then each such argument's new value
    (None: left alone), written back here. Without a lowering: its decomposition, else unsupported (whose CPU
    fallback writes them back)."""
    lowering = LOWERINGS.get(func)
    if lowering is None:
        decomposed = decompose(func, args, kwargs)
        return decomposed if decomposed is not NotImplemented else unsupported(func, args, kwargs)
    names = UNDECLARED_WRITES[func]
    bound = bind(func, args, kwargs)
    results = execute(func, lowering, args, kwargs, extra=len(names))
    n = len(results) - len(names)
    for name, value in zip(names, results[n:]):
        if value is not None and bound.get(name) is not None:
            write(func, bound[name], value)
    own = results[:n]
    return own[0] if n == 1 else tuple(own)


def _run_mutating_lowering(func, args, kwargs):
    """A lowering registered directly on a mutating op returns the new values of written args."""
    written = written_args(func)
    bound = bind(func, args, kwargs)
    new_values = execute(func, LOWERINGS[func], args, kwargs)
    if len(written) == 1:
        new_values = [new_values]
    for name, value in zip(written, new_values):
        write(func, bound[name], value)
    return bound[written[0]] if len(written) == 1 else tuple(bound[n] for n in written)


def _enable_foreach_optimizers() -> None:
    """Optimizers, and `clip_grad_norm_` / `clip_grad_value_` (torch.utils._foreach_utils), pick their multi-tensor
    path only for listed tensor types; a C++ backend's tensors are plain `torch.Tensor`, ours a subclass, so list
    it. Unlisted, `clip_grad_norm_` over a 24-layer model's ~300 gradients ran ~600 ops a step, one per gradient."""
    import torch.optim.optimizer as optimizer_module
    import torch.utils._foreach_utils as foreach_utils

    for module in (optimizer_module, foreach_utils):
        supported = getattr(module, "_foreach_supported_types", None)
        if isinstance(supported, list) and TpuTensor not in supported:
            supported.append(TpuTensor)


_enable_foreach_optimizers()  # here, on the first op: `import torch` must not load JAX
install_dispatcher(dispatch)  # every op on a TpuTensor comes here from now on
