"""Where in the user's code an op ran: file:line for HLO metadata, hot-op tables and graph breaks."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

# Our own code and the libraries under it, by the folders their modules load from (a user's
# ~/src/backend/train.py is the user's, however its folders are named).
_OWN_PACKAGES = ("torch", "jax", "jaxlib", "tpu_agent", "tpu_agent.backend", "tpu_agent.profilers")
_roots: tuple[str, ...] | None = None


def own_roots() -> tuple[str, ...]:
    """The folders (with a trailing separator) and files whose frames are not the user's."""
    global _roots
    if _roots is None:
        found = [runpy.__file__]
        for name in _OWN_PACKAGES:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            for folder in (spec.submodule_search_locations or []) if spec is not None else []:
                found += [os.path.join(folder, ""), os.path.join(os.path.realpath(folder), "")]
        _roots = tuple(dict.fromkeys(found))
    return _roots


def is_own_code(filename: str) -> bool:
    return filename.startswith("<frozen") or filename.startswith(own_roots())


def user_frame(skip: int = 2) -> str | None:
    """file:line of the innermost frame outside torch, JAX and this package (a model's own
    code counts: a Hugging Face modeling file is where the op was written)."""
    frame = sys._getframe(skip)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_own_code(filename):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def user_stacklevel() -> int:
    """`warnings.warn`'s stacklevel, called from the function that warns, that names the user's line (the innermost
    frame outside torch, JAX and this package), not ours; 1 where there is none."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and is_own_code(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
