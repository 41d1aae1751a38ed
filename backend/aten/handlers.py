"""Device handlers: ops that are not array math, run with their torch-level arguments.

The tensor's device, `.item()`, pinned-memory queries, copies between the CPU and the device (`.to`,
`copy_`, and PyTorch's C++ copy kernels through `copy_into`), and fused Adam's calls re-spelled for
its lowering (a float learning rate as a tensor; the gradients written only when unscaled). Registered
in opinfo's handler table when dispatch.py imports this module.
"""

from __future__ import annotations

import jax
import torch

from ..core import dtypes
from ..distributed import functional  # noqa: F401  (the functional collectives' handlers, registered with these)
from .opinfo import handler
from ..core.state import STATE, STATS
from ..core.tensor import DEVICE, TpuTensor, device_index
from ..core.transfer import from_cpu, materialize, to_cpu, to_device
from .writes import broadcast_cast, cast, write

aten = torch.ops.aten


@handler(torch.ops.prim.device.default)
def _device(x):
    return x.device


@handler(aten._local_scalar_dense.default, aten.item.default)  # item: bool(t)'s decomposition (DTensor's RNG check)
def _item(x):
    value = materialize(x, "Tensor.item()")
    STATS.d2h_count += 1
    STATS.d2h_bytes += value.dtype.itemsize * value.size
    return jax.device_get(value).item()


@handler(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(x, assert_msg="Expected Tensor with single nonzero value, but got zero"):
    """CUDA checks later, at a kernel launch; here the value is read now (a sync point: TorchTitan's RoPE
    position check, once per layer and step)."""
    if not _item(x):
        raise RuntimeError(assert_msg)


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
    elif STATE.device_count > 1 and device_index(target) != x.device.index:  # tpu:j -> tpu:k
        moved = TpuTensor(to_device(x, device_index(target)))
        return moved if dtype is None or dtype == x.dtype else TpuTensor(cast(moved.jax(), dtypes.to_jax_dtype(dtype)))
    want = dtypes.to_jax_dtype(dtype) if dtype is not None else x.jax().dtype
    return TpuTensor(cast(x.jax(), want))


@handler(aten.copy_.default)
def _copy_(dst, src, non_blocking=False):
    return copy_into(dst, src)


def copy_into(dst, src):
    """`dst.copy_(src)` where either side is on the device."""
    if isinstance(dst, TpuTensor):
        if not isinstance(src, TpuTensor):
            value = from_cpu(src)
        elif src.device != dst.device:  # tpu:j -> tpu:k
            value = to_device(src, dst.device.index)
        else:
            value = src.jax()
        if tuple(value.shape) != tuple(dst.shape):  # copy_ broadcasts src to dst, an empty dst included
            value = broadcast_cast(value, tuple(dst.shape), dtypes.to_jax_dtype(dst.dtype))
        write(aten.copy_.default, dst, value)
        return dst
    # CPU destination, tpu source.
    dst.copy_(to_cpu(src))
    return dst


def _lr_tensor(lr):
    """A float learning rate as a 0-d CPU tensor: an input of the program, not a constant (ops/optim.py)."""
    return lr if isinstance(lr, torch.Tensor) else torch.tensor(float(lr), dtype=torch.float32)


def _fused_adam_functional(op):
    def run(*args, lr, **kwargs):
        return op(*args, lr=_lr_tensor(lr), **kwargs)

    return run


def _fused_adam_in_place(op):
    """`_fused_adamw_`: the functional op's new values written back. The gradients only where `grad_scale`
    unscaled them, as the CPU kernel does: a compiled step's program may not write into its gradient
    arguments (they can be views)."""

    def run(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, amsgrad, grad_scale=None,
            **kwargs):
        new = op(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=_lr_tensor(lr),
                 amsgrad=amsgrad, grad_scale=grad_scale, **kwargs)
        written = [(params, new[0]), (exp_avgs, new[2]), (exp_avg_sqs, new[3])]
        written += [(grads, new[1])] if grad_scale is not None else []
        written += [(max_exp_avg_sqs, new[4])] if amsgrad else []
        for targets, values in written:
            write(op, targets, values)

    return run


for _functional, _in_place in ((aten._fused_adam, aten._fused_adam_), (aten._fused_adamw, aten._fused_adamw_)):
    handler(_functional.default)(_fused_adam_functional(_functional.tensor_lr))
    handler(_in_place.default, _in_place.tensor_lr)(_fused_adam_in_place(_functional.tensor_lr))
