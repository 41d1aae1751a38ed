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
    return True
