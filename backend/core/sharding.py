"""Sharding over a device mesh: parameters placed by name rules, batches split.

A mesh spans `jax.devices()` (on a CPU host, N simulated devices through
`TPU_AGENT_DEVICES=N`). A tensor is sharded by placing its array with a
`NamedSharding`; every program that reads it (eager ops, fused graphs,
compiled steps) is then partitioned by XLA's SPMD partitioner, so results
equal the unsharded run up to float reassociation.

    mesh = torch.tpu.sharding.set_mesh({"data": 2, "model": 2})
    torch.tpu.sharding.shard_module(model, [("*.fc1.weight", ("model", None))])
    torch.tpu.sharding.shard_batches(model, axis="data")   # inputs split on dim 0
"""

from __future__ import annotations

import fnmatch
import math

import jax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import bytes_per_device, get_mesh, set_mesh  # noqa: F401  (torch.tpu.sharding's names)
from .tensor import TpuTensor
from .transfer import materialize


def _require_mesh() -> Mesh:
    mesh = get_mesh()
    if mesh is None:
        raise RuntimeError("no device mesh: call torch.tpu.sharding.set_mesh({...}) first")
    return mesh


def check_spec(shape, spec, mesh: Mesh | None = None) -> str | None:
    """Why `spec` cannot shard a tensor of `shape` on the mesh, or None if it can."""
    mesh = mesh or _require_mesh()
    if len(spec) > len(shape):
        return f"spec {tuple(spec)} has more entries than the tensor has dims {tuple(shape)}"
    for dim, axes in enumerate(spec):
        if axes is None:
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        for name in names:
            if name not in mesh.shape:
                return f"mesh has no axis {name!r} (axes: {list(mesh.shape)})"
        parts = math.prod(mesh.shape[n] for n in names)
        if shape[dim] % parts:
            return f"dim {dim} of size {shape[dim]} does not divide over {parts} devices ({axes})"
    return None


def shard_tensor(tensor: TpuTensor, spec) -> None:
    """Place the tensor's storage on the mesh with PartitionSpec(*spec), in place."""
    mesh = _require_mesh()
    problem = check_spec(tuple(tensor.shape), tuple(spec), mesh)
    if problem:
        raise ValueError(f"cannot shard a tensor of shape {tuple(tensor.shape)}: {problem}")
    if tensor._view_chain:
        raise ValueError("shard the base tensor, not a view of it")
    array = materialize(tensor)
    tensor._storage_box.place(jax.device_put(array, NamedSharding(mesh, PartitionSpec(*spec))))


def shard_module(module: torch.nn.Module, rules, *, strict: bool = True) -> list[tuple[str, tuple]]:
    """Shard parameters and buffers whose name matches a rule's glob; first match wins; the rest replicate.

    With strict=False a tensor the rule cannot split (a dim that does not divide
    over the mesh axis, as with a 10-class head under a 4-way FSDP rule) is
    replicated instead, as FSDP implementations do for small tensors; its spec
    is reported as (). Returns (name, spec) for every tensor placed.
    """
    mesh = _require_mesh()
    placed = []
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if not isinstance(tensor, TpuTensor):
            continue
        spec = next((tuple(s) for pattern, s in rules if fnmatch.fnmatchcase(name, pattern)), ())
        if not strict and check_spec(tuple(tensor.shape), spec, mesh):
            spec = ()
        shard_tensor(tensor, spec)
        placed.append((name, spec))
    return placed


def shard_batches(module: torch.nn.Module, axis: str = "data"):
    """Split every tensor argument of `module`'s forward along dim 0 over mesh axis `axis`."""
    _require_mesh()

    def hook(mod, args, kwargs):
        for t in _tensors((args, kwargs)):
            if t.dim() >= 1 and not t._view_chain:
                shard_tensor(t, (axis,))
        return None

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _tensors(tree):
    if isinstance(tree, TpuTensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


