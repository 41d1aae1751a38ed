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

from . import handlers, ops  # noqa: F401  (they fill the handler and lowering tables)
from .execute import execute
from .fallback import decompose, unsupported
from .handlers import copy_into  # noqa: F401  (device.py's copy kernel)
from .opinfo import (
    INFO,
    MUTATING,
    UNDECLARED_WRITES,
    VIEW,
    bind,
    functional_call_args,
    functional_variant,
    info_of,
    is_list_return,
    is_out,
    written_args,
)
from .registry import LOWERINGS
from .state import STATS
from .tensor import TpuTensor, install_dispatcher
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


def run_mutating(func, args, kwargs):
    """A mutating op: its own lowering, else its functional variant dispatched (it may be a handler's or
    a decomposition's) and the new values written into the written arguments."""
    if func in METADATA_INPLACE:
        return run_metadata_inplace(func, args, kwargs)
    if func in UNDECLARED_WRITES:
        return run_undeclared(func, args, kwargs)
    if func in LOWERINGS:
        return _run_mutating_lowering(func, args, kwargs)
    functional = functional_variant(func)
    if functional is None:
        decomposed = decompose(func, args, kwargs)
        if decomposed is not NotImplemented:
            return decomposed
        return unsupported(func, args, kwargs)
    written = written_args(func)
    bound = bind(func, args, kwargs)
    fargs, fkwargs = functional_call_args(func, functional, bound)
    result = dispatch(functional, fargs, fkwargs)
    results = list(result) if isinstance(result, (list, tuple)) and not is_list_return(functional) else [result]
    n_returns = len(functional._schema.returns)
    # Conventions: `foo_` returns the new self; `foo_functional` returns outputs then new
    # values of the written arguments; `foo.out` returns the outputs written into `out`.
    targets = [bound[name] for name in written]
    if func.overloadpacket.__name__.endswith("_") or is_out(func):
        values = results[: len(targets)] if len(targets) > 1 else [result]
    else:
        values = results[n_returns - len(targets):]
    for target, value in zip(targets, values):
        write(func, target, value)
    if not func._schema.returns:
        return None
    if func.overloadpacket.__name__.endswith("_") or is_out(func):
        # What the schema returns: `_amp_update_scale_` writes two arguments, returns one.
        n = len(func._schema.returns)
        return targets[0] if n == 1 else tuple(targets[:n])
    # An op that updates some arguments and returns other things (batch norm's running
    # statistics): its own outputs lead the functional variant's.
    own = results[: len(func._schema.returns)]
    return own[0] if len(own) == 1 else tuple(own)


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
