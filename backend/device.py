"""Registers the `tpu` device: PrivateUse1 renamed, `torch.tpu`, allocation kernels."""

from __future__ import annotations

import warnings

import torch

# Ops with no tensor argument reach a backend through the device they name:
# PyTorch sends them to the PrivateUse1 kernels registered here.
FACTORY_OPS = (
    "empty.memory_format",
    "empty_strided",
    "arange",
    "arange.start",
    "arange.start_step",
    "full",
    "zeros",
    "ones",
    "rand",
    "randn",
    "randint",
    "randint.low",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "eye.m",
    "scalar_tensor",
    "tril_indices",
    "triu_indices",
)

_library = None


def _factory_kernel(op):
    def kernel(*args, **kwargs):
        from .dispatch import dispatch

        return dispatch(op, args, kwargs)

    return kernel


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def register() -> bool:
    """Make `tpu` a PyTorch device backed by JAX; False if another backend owns PrivateUse1."""
    global _library
    from . import module

    current = torch._C._get_privateuse1_backend_name()
    if current == "tpu" and getattr(torch, "tpu", None) is module:
        return True
    if current != "privateuseone":
        warnings.warn(f"tpu-agent: PrivateUse1 already belongs to {current!r}; the bundled tpu device stands aside")
        return False
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend("tpu", backend_module=module)
    _library = torch.library.Library("aten", "IMPL")
    for name in FACTORY_OPS:
        _library.impl(name, _factory_kernel(_overload(name)), "PrivateUse1")
    _enable_foreach_optimizers()
    _group_by_python_device()
    from .steps import install_optimizer_hook

    install_optimizer_hook()
    _patch_torch_compile()
    _patch_tensor_constructors()
    _route_accelerator_synchronize()
    return True


def _group_by_python_device() -> None:
    """Optimizers and clip_grad_norm_ group tensors by their C++ device, which for our
    wrapper is meta; key our tensors' groups by `tpu:0`, the device they report."""
    from .tensor import DEVICE, TpuTensor

    original = torch._C._group_tensors_by_device_and_dtype
    if getattr(original, "_tpu_agent", False):
        return

    def group(tensorlistlist, with_indices=False):
        grouped = original(tensorlistlist, with_indices)
        remapped = {}
        for (device, dtype), value in grouped.items():
            if device.type == "meta" and any(isinstance(t, TpuTensor) for t in value[0][0]):
                device = DEVICE
            remapped[(device, dtype)] = value
        return remapped

    group._tpu_agent = True
    torch._C._group_tensors_by_device_and_dtype = group


def _patch_tensor_constructors() -> None:
    """`torch.tensor(data, device="tpu")` copies its data in with Python dispatch off, which our
    wrapper never sees (the values would be lost): build on the CPU, then move."""
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)
        if not getattr(original, "_tpu_agent", False):
            setattr(torch, name, _tpu_aware_constructor(name, original))


def _tpu_aware_constructor(name, original):
    positional_device = 1 if name == "as_tensor" else None  # as_tensor(data, dtype=None, device=None)

    def constructor(data, *args, **kwargs):
        args = list(args)
        device = kwargs.get("device")
        if positional_device is not None and len(args) > positional_device:
            device = args[positional_device]
        # Explicit devices only: torch.get_default_device() itself calls torch.tensor.
        target = torch.device(device) if device is not None else None
        if target is None or target.type != "tpu":
            return original(data, *args, **kwargs)
        if isinstance(data, torch.Tensor) and data.device.type == "tpu":
            dtype = kwargs.get("dtype", args[0] if args else None)
            out = data.detach() if name == "as_tensor" else data.detach().clone()
            out = out.to(dtype) if dtype is not None else out
        else:
            requires_grad = kwargs.pop("requires_grad", False)
            if positional_device is not None and len(args) > positional_device:
                args[positional_device] = "cpu"
            else:
                kwargs["device"] = "cpu"
            out = original(data, *args, **kwargs).to(target)
            if requires_grad:
                out.requires_grad_(True)
        return out

    constructor._tpu_agent = True
    constructor.__doc__ = original.__doc__
    return constructor


def _patch_torch_compile() -> None:
    """As TorchTPU does: `torch.compile` on tpu tensors uses the tpu backend (imports JAX lazily)."""
    original = torch.compile
    if getattr(original, "_tpu_agent", False):
        return

    def compile(model=None, **kwargs):
        from .compile import patch_torch_compile

        torch.compile = original
        patch_torch_compile()
        return torch.compile(model, **kwargs)

    compile._tpu_agent = True
    compile.__doc__ = original.__doc__
    torch.compile = compile


def _route_accelerator_synchronize() -> None:
    """`torch.accelerator.synchronize()` asks the C++ device guard, which a Python
    backend cannot implement; send it to `torch.tpu.synchronize` instead."""
    import torch.accelerator as accelerator

    original = accelerator.synchronize
    if getattr(original, "_tpu_agent", False):
        return

    def synchronize(device=None):
        target = torch.device(device) if isinstance(device, str) else device
        if target is None or isinstance(target, int) or target.type == "tpu":
            from .module import synchronize as tpu_synchronize

            return tpu_synchronize()
        return original(device)

    synchronize._tpu_agent = True
    synchronize.__doc__ = original.__doc__
    accelerator.synchronize = synchronize


def _enable_foreach_optimizers() -> None:
    """Optimizers pick their multi-tensor path only for listed tensor types; a C++
    backend's tensors are plain `torch.Tensor`, ours a subclass, so list it."""
    import torch.optim.optimizer as optimizer_module

    from .tensor import TpuTensor

    supported = getattr(optimizer_module, "_foreach_supported_types", None)
    if isinstance(supported, list) and TpuTensor not in supported:
        supported.append(TpuTensor)
