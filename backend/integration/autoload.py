"""Entry point PyTorch calls at the end of `import torch` (group `torch.backends`).

It must be cheap and must never break `import torch`: JAX and the lowerings are
imported on the first op, not here.
"""

from __future__ import annotations

import importlib.util
import warnings

from tpu_agent import envvars


def torch_tpu_present() -> bool:
    """Google's TorchTPU drives real TPUs; where it is installed, the bundled device stands aside."""
    return importlib.util.find_spec("torch_tpu") is not None


def autoload() -> None:
    if envvars.DEVICE.get() == "off":
        return
    if torch_tpu_present() and envvars.DEVICE.get() != "bundled":
        return
    try:
        from .device import register

        register()
    except Exception as exc:  # a broken device must not break `import torch`
        warnings.warn(f"tpu-agent: the bundled tpu device could not be registered: {exc}", stacklevel=2)
