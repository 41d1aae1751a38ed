"""Where in the user's code an op ran: file:line for HLO metadata, hot-op tables and graph breaks."""

from __future__ import annotations

import os
import sys

_OWN_CODE = ("/torch/", "/jax/", "/jaxlib/", "/tpu_agent/", "/backend/", "/profilers/", "<frozen", "/runpy.py")


def user_frame(skip: int = 2) -> str | None:
    """file:line of the innermost frame outside torch, JAX and this package (a model's own
    code counts: a Hugging Face modeling file is where the op was written)."""
    frame = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _OWN_CODE):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None
