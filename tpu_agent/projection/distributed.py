"""A torch.distributed script traced for a projection: one rank, its own parallelism left to the projection.

The projection shards the step itself, by the mesh and rules it is given (partition.py). The script's FSDP2,
tensor-parallel and DDP wrappers would shard it a second time, and FSDP2 refuses the meta tensors the trace
holds; here they leave the module as it is, and `init_process_group` finds a group of one rank. What the
script's mesh would be is the projection's to choose (`tune --nproc N --target SLICE` ranks the meshes).
"""

from __future__ import annotations

import contextlib


def _unchanged(module, *args, **kwargs):
    return module


class _Replicated:
    """DistributedDataParallel's face with nothing behind it: `.module`, `no_sync()`, the call."""

    def __new__(cls, module, *args, **kwargs):
        # Plain attributes, not submodules: `module.module` registered as its own child would recurse.
        object.__setattr__(module, "module", module)
        if not hasattr(module, "no_sync"):
            object.__setattr__(module, "no_sync", contextlib.nullcontext)
        return module


_TARGETS = (
    ("torch.distributed.fsdp", "fully_shard", _unchanged),
    ("torch.distributed._composable.fsdp", "fully_shard", _unchanged),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "fully_shard", _unchanged),
    ("torch.distributed.tensor.parallel", "parallelize_module", _unchanged),
    ("torch.distributed.tensor.parallel.api", "parallelize_module", _unchanged),
    ("torch.nn.parallel", "DistributedDataParallel", _Replicated),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", _Replicated),
)


@contextlib.contextmanager
def script_parallelism_left_out():
    """While the script runs: its fully_shard, parallelize_module and DDP leave the module unchanged."""
    import importlib

    saved = []
    for module_name, attr, replacement in _TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, replacement)
    try:
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
