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
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .tensor import TpuTensor

_mesh: Mesh | None = None


def set_mesh(axes: dict[str, int] | None) -> Mesh | None:
    """Build the mesh (axis name -> size, product = device count used) or clear it with None."""
    global _mesh
    from . import modes

    if axes is None:
        _mesh = None
        modes.serialize_programs = False
        return None
    devices = jax.devices()
    size = math.prod(axes.values())
    if size > len(devices) or size < 1:
        raise ValueError(f"a mesh of {dict(axes)} needs {size} devices; {len(devices)} are available "
                         "(on a CPU host set TPU_AGENT_DEVICES)")
    _mesh = Mesh(np.array(devices[:size]).reshape(tuple(axes.values())), tuple(axes.keys()))
    modes.serialize_programs = size > 1 and jax.default_backend() == "cpu"
    return _mesh


def get_mesh() -> Mesh | None:
    return _mesh


def _require_mesh() -> Mesh:
    if _mesh is None:
        raise RuntimeError("no device mesh: call torch.tpu.sharding.set_mesh({...}) first")
    return _mesh


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
    from .dispatch import materialize

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


def align(args: list) -> list:
    """Arrays pinned to one device, in a program that also reads mesh-placed arrays, are
    replicated over the mesh first (XLA refuses to mix the two). Nothing to do without a mesh."""
    mesh = _mesh
    if mesh is None or mesh.size == 1:
        return args
    mesh_devices = set(mesh.devices.flat)
    arrays = [a for a in args if isinstance(a, jax.Array)]
    if not any(a.sharding.device_set == mesh_devices for a in arrays):
        return args
    replicated = NamedSharding(mesh, PartitionSpec())
    return [jax.device_put(a, replicated)
            if isinstance(a, jax.Array) and a.committed and a.sharding.device_set != mesh_devices else a
            for a in args]


def bytes_per_device() -> dict[str, int]:
    """Bytes of live device arrays held on each device (what sharding saves)."""
    totals: dict[str, int] = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            key = str(shard.device)
            totals[key] = totals.get(key, 0) + shard.data.nbytes
    return totals
