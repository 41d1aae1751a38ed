"""An optimizer's `step()` as one XLA program, with no change to the script.

A foreach AdamW over a model's parameters is a few dozen list ops; run op by
op, their Python costs more than their math on a small model. Here the update
is captured once (see step_program.py) with the gradients as arguments and the
parameters and optimizer state as storages it reads and writes, then replayed:
`optimizer.step()` becomes one launch.

The optimizer's own hooks (and PyTorch's global ones, such as the step marker
the profiler uses) still run on every call, around the program. For SGD, Adam and
AdamW the learning rate is an input of the program (a 0-d device tensor in the
group while it is captured, as PyTorch's capturable optimizers allow), so an
LR scheduler's new `lr` at every step replays the same program. Any other
hyperparameter change means a new capture; one that changes every step makes
the update give up replaying and run fused, which is correct but not one
program (`reason_not_replayed`).
"""

from __future__ import annotations

import functools
import types
from itertools import chain

import jax.numpy as jnp
import torch
import torch.nn.utils.clip_grad
import torch.optim.optimizer as optimizer_module

from ..core import executables, lazy, modes
from ..core.lazy import RECORDER
from ..ops.reduction import vector_norm
from .step_program import CompiledStep, make_capturable
from ..core.tensor import TpuTensor, on_device
from .whole_step import recording


def _fused_adam_meta(*args, **kwargs) -> None:
    """PyTorch registers no Meta kernel for the tensor-lr overloads of the in-place fused Adam (2.13): DTensor's
    sharding propagation runs an op on meta tensors first, so an FSDP2 model's program step failed there. The
    in-place update returns nothing and changes no shape: nothing to compute."""
    return None


_META = torch.library.Library("aten", "IMPL")
for _op in ("_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr"):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{_op}", "Meta"):  # a later PyTorch's own wins
        _META.impl(_op, _fused_adam_meta, "Meta")

# Optimizers whose update takes `lr` as a 0-d tensor (with capturable=True) and computes the same math.
TENSOR_LR = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class OptimizerProgram:
    def __init__(self, optimizer, raw_step):
        self.raw_step = raw_step  # the optimizer class's step, without PyTorch's hook wrapper
        self.tensor_lr = type(optimizer) in TENSOR_LR and all(type(g["lr"]) is float for g in optimizer.param_groups)
        self.program = CompiledStep(self._update, marks_steps=False, capture_when_fused=True,
                                    varying=("lr",) if self.tensor_lr else (),
                                    name=f"{type(optimizer).__name__}.step")
        self._lrs: dict[float, TpuTensor] = {}

    def lrs(self, optimizer) -> list:
        """This step's learning rates as device scalars (one transfer per new value)."""
        if not self.tensor_lr:
            return []
        out = []
        for group in optimizer.param_groups:
            lr = float(group["lr"])  # a scheduler may set an int
            index = (group["params"][0].device.index or 0) if group["params"] else 0  # on the parameters' tpu:k
            t = self._lrs.get((lr, index))
            if t is None:
                if len(self._lrs) > 64:
                    self._lrs.clear()
                t = self._lrs[lr, index] = on_device(index, TpuTensor, jnp.asarray(lr, jnp.float32))
            out.append(t)
        return out

    def _update(self, optimizer, grads, lrs):
        """Reads the gradients through the parameters, as the optimizer does; `grads` and `lrs` name
        them as the program's arguments, so each replay reads this step's values."""
        saved = [group["lr"] for group in optimizer.param_groups]
        try:
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
            return self.raw_step(optimizer)
        finally:
            for group, lr in zip(optimizer.param_groups, saved):
                group["lr"] = lr

    @property
    def replays(self) -> int:
        return self.program.replays

    @property
    def reason_not_replayed(self) -> str | None:
        return self.program.reason_not_replayed


def _local(grad):
    """A DTensor gradient (FSDP2, tensor parallel) as its local shard, the tensor the update reads: FSDP2's
    reduce-scatter makes new gradients every step, and only an argument, not a storage the capture saw, is
    read anew by each replay."""
    local = getattr(grad, "_local_tensor", None)
    return grad if local is None else local


def _program_step(optimizer, closure=None):
    """`optimizer.step` once a program: PyTorch's hooks around the replayed update."""
    program: OptimizerProgram = optimizer.__dict__["_tpu_program"]
    if closure is not None:  # a closure re-evaluates the model: not one program
        return type(optimizer).step(optimizer, closure)
    args, kwargs = (optimizer,), {}
    for hook in chain(optimizer_module._global_optimizer_pre_hooks.values(),
                      optimizer._optimizer_step_pre_hooks.values()):
        hook(optimizer, args, kwargs)
    grads = [_local(p.grad) for group in optimizer.param_groups for p in group["params"]]
    out = program.program(optimizer, grads, program.lrs(optimizer))
    optimizer._opt_called = True  # what an LR scheduler's wrapper would note
    optimizer._optimizer_step_code()
    for hook in chain(optimizer._optimizer_step_post_hooks.values(),
                      optimizer_module._global_optimizer_post_hooks.values()):
        hook(optimizer, args, kwargs)
    return out


_program_step._wrapped_by_lr_sched = True  # we note `_opt_called` ourselves: schedulers need not wrap us


def _zero_grad(optimizer, set_to_none: bool = True):
    """`zero_grad(set_to_none=False)` zeroes every gradient in place after the step's program: one fused graph, not
    an op per gradient."""
    if set_to_none:
        return type(optimizer).zero_grad(optimizer, set_to_none)
    with modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE):
        return type(optimizer).zero_grad(optimizer, set_to_none)


def install(optimizer) -> OptimizerProgram | None:
    """Make `optimizer.step()` run as a program from its next call on; None where it cannot."""
    existing = optimizer.__dict__.get("_tpu_program")
    if existing is not None:
        return existing
    raw_step = getattr(type(optimizer).step, "__wrapped__", None)
    if raw_step is None:  # not PyTorch's hooked step: leave it alone
        return None
    make_capturable(optimizer)
    program = OptimizerProgram(optimizer, raw_step)
    optimizer._tpu_program = program
    optimizer.step = types.MethodType(_program_step, optimizer)
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)
    return program


# --- gradient clipping as one node -------------------------------------------------------------------------------
# `clip_grad_norm_` on the device takes PyTorch's foreach path: a few ops a call, but `_foreach_norm` returns a
# tensor per gradient (~300 wrappers a step for a 24-layer model, made, tracked and flushed every step). Inside a
# compiled step's window the same math is recorded as one node of the step's graph: the gradients in, the total
# norm and the clipped gradients out, written back into the gradients' storages (as `_foreach_mul_` writes them).

_CLIP_NODES: dict[tuple, lazy.Program] = {}
_ORIGINAL_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
clip_nodes_recorded = 0  # calls recorded as one node (tests read it)


def _clip_program(count: int, norm_type: float, max_norm: float) -> lazy.Program:
    """PyTorch's math, op for op: each gradient's norm (`_foreach_norm`), the norm of their stack, then
    `max_norm / (total + 1e-6)` (Tensor.__rdiv__: a reciprocal times the number), clamped at 1, times each
    gradient. The numbers are constants of the program: another max_norm or norm_type is another node."""
    key = (count, norm_type, max_norm)
    program = _CLIP_NODES.get(key)
    if program is None:
        def clip(*grads):
            total = vector_norm(jnp.stack([vector_norm(g, norm_type) for g in grads]), norm_type)
            coef = jnp.minimum(jnp.reciprocal(total + 1e-6) * max_norm, 1.0)
            return [total, *(g * coef.astype(g.dtype) for g in grads)]

        program = _CLIP_NODES[key] = lazy.Program(executables.next_id(), "clip_grad_norm_", clip, {},
                                                  scope="clip_grad_norm_")
    return program


def _recordable(grads) -> bool:
    if not grads or not recording():
        return False
    first = grads[0]
    if type(first) is not TpuTensor or not first.is_floating_point() or first.dtype not in (torch.float32,
                                                                                           torch.float64):
        return False
    dtype, device = first.dtype, first.device
    # A view (DDP's gradients as bucket views) is written through its base: left to the ops as written.
    return all(type(g) is TpuTensor and not g._view_chain and g.dtype == dtype and g.device == device for g in grads)


@functools.wraps(_ORIGINAL_CLIP)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """`torch.nn.utils.clip_grad_norm_`; inside a compiled step's window, one node of the step's graph."""
    global clip_nodes_recorded
    if error_if_nonfinite or not recording():  # the check reads the norm on the host: as written
        return _ORIGINAL_CLIP(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not _recordable(grads):  # a generator stays one: PyTorch warns when it was empty
        again = (p for p in params) if isinstance(parameters, types.GeneratorType) else params
        return _ORIGINAL_CLIP(again, max_norm, norm_type, error_if_nonfinite, foreach)
    program = _clip_program(len(grads), float(norm_type), float(max_norm))
    total, *clipped = RECORDER.record(program, [g.jax() for g in grads])
    for g, value in zip(grads, clipped):
        g._storage_box.write(value)
    clip_nodes_recorded += 1
    return TpuTensor(total)


def install_clip() -> None:
    """Route `torch.nn.utils.clip_grad_norm_` through the node above (as written outside a window)."""
    import torch.nn.utils as utils

    utils.clip_grad_norm_ = clip_grad_norm_
    utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
