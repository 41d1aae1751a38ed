"""Registers the `tpu` device: PrivateUse1 renamed, `torch.tpu`, allocation kernels."""

from __future__ import annotations

import sys
import warnings

import torch

# Loaded at `import torch` (the torch.backends entry point): only modules that do not
# import JAX come in here; the rest arrive with the first op.
from ..nn import attention, lazy_modules, recurrent, transformer
from ..compiled import auto_compile
from . import autocast, checkpoints, module, pinned
from ..core import memory
from ..distributed import process_group
from ..core.jax_setup import device_x64
from ..core.steps import install_optimizer_hook

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
    "_efficientzerotensor",  # no tensor argument: it reaches the device only through its key
)

_library = None


def _factory_kernel(op):
    @device_x64()  # these kernels enter the device beside __torch_dispatch__: the same 64-bit scope
    def kernel(*args, **kwargs):
        from ..aten.dispatch import dispatch
        from ..core.tensor import STATE, device_index, on_device

        if STATE.device_count == 1:
            return dispatch(op, args, kwargs)
        return on_device(device_index(kwargs.get("device")), dispatch, op, args, kwargs)

    return kernel


# PyTorch's C++ code copies into a device tensor with Python dispatch off (as
# `torch.tensor(data, device="tpu")` does); such copies reach these C++ kernels.
COPY_OPS = ("_copy_from", "_copy_from_and_resize")


@device_x64()
def _copy_kernel(src, dst, *args):
    from ..aten.dispatch import copy_into
    from ..core.tensor import STATE, TpuTensor, on_device

    if STATE.device_count == 1:
        return copy_into(dst, src)
    where = dst if isinstance(dst, TpuTensor) else src
    return on_device(where.device.index, copy_into, dst, src)


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def register() -> bool:
    """Make `tpu` a PyTorch device backed by JAX; False if another backend owns PrivateUse1."""
    global _library
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
    for name in COPY_OPS:
        _library.impl(name, _copy_kernel, "PrivateUse1")
    # A wrapper on a PrivateUse1 device makes autograd run backward on a per-device thread;
    # keep it on the caller's (the graph recorder and step capture are not thread-safe).
    torch.autograd.set_multithreading_enabled(False)
    pinned.register()
    autocast.register()
    attention.register()
    recurrent.register()
    transformer.register()
    checkpoints.register()
    lazy_modules.register()
    install_optimizer_hook()
    auto_compile.enable_from_environment()
    _patch_torch_compile()
    _route_accelerator_synchronize()
    _route_accelerator_device_index()
    _accelerator_only_when_used()
    process_group.register()
    memory.route_accelerator_memory()
    return True


def _patch_torch_compile() -> None:
    """As TorchTPU does: `torch.compile` on tpu tensors uses the tpu backend (imports JAX lazily)."""
    original = torch.compile
    if getattr(original, "_tpu_agent", False):
        return

    def compile(model=None, **kwargs):
        from ..compiled.compile import patch_torch_compile

        torch.compile = original
        patch_torch_compile()
        return torch.compile(model, **kwargs)

    compile._tpu_agent = True
    compile.__doc__ = original.__doc__
    torch.compile = compile


def _accelerator_only_when_used() -> None:
    """`init_process_group()` picks its backend for "the accelerator", which C++ reports as tpu as soon as the
    device is registered (at `import torch`), so a CPU-only script launched by torchrun failed with the tool
    installed ("we don't know which communication backend to use"). Python's callers are told the CPU until
    tpu is in use, as `torch.accelerator.is_available()` already says (module.is_available). Only
    torch.distributed is told so: the DataLoader asks the same question to pin batches for tpu, and a tpu
    script may build its loader before its first op."""
    original = torch._C._get_accelerator
    if getattr(original, "_tpu_agent", False):
        return

    def get_accelerator(*args, **kwargs):
        found = original(*args, **kwargs)
        if (found.type == "tpu" and not module.is_available()
                and sys._getframe(1).f_globals.get("__name__", "").startswith("torch.distributed")):
            return torch.device("cpu")
        return found

    get_accelerator._tpu_agent = True
    torch._C._get_accelerator = get_accelerator


def _route_accelerator_device_index() -> None:
    """`torch.accelerator.set_device_index` / `current_device_index` ask the C++ device guard, which a Python
    backend cannot implement (it answers 0 and ignores a change): send them to `torch.tpu` while tpu is the
    accelerator."""
    import torch.accelerator as accelerator

    if getattr(accelerator.set_device_index, "_tpu_agent", False):
        return
    original_set, original_current = accelerator.set_device_index, accelerator.current_device_index

    def on_tpu():
        return torch._C._get_accelerator().type == "tpu"

    def set_device_index(device, /):
        if not on_tpu():
            return original_set(device)
        return module.set_device(device)

    def current_device_index():
        return module.current_device() if on_tpu() else original_current()

    for name, fn, original in (("set_device_index", set_device_index, original_set),
                               ("set_device_idx", set_device_index, original_set),
                               ("current_device_index", current_device_index, original_current),
                               ("current_device_idx", current_device_index, original_current)):
        if hasattr(accelerator, name):
            fn._tpu_agent = True
            fn.__doc__ = original.__doc__
            setattr(accelerator, name, fn)


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
