"""The device mesh: which devices programs span, and placing program inputs on it.

Kept apart from the user-facing sharding API (sharding.py) because running any program
needs it (launch.py), while that API needs tensors.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .state import STATE


def set_mesh(axes: dict[str, int] | None) -> Mesh | None:
    """Build the mesh (axis name -> size, product = device count used) or clear it with None."""
    if axes is None:
        STATE.set_mesh(None)
        return None
    devices = jax.devices()
    size = math.prod(axes.values())
    if size > len(devices) or size < 1:
        raise ValueError(f"a mesh of {dict(axes)} needs {size} devices; {len(devices)} are available "
                         "(on a CPU host set TPU_AGENT_DEVICES)")
    mesh = Mesh(np.array(devices[:size]).reshape(tuple(axes.values())), tuple(axes.keys()))
    # XLA's CPU client deadlocks on two programs with collectives over simulated devices in flight at once.
    STATE.set_mesh(mesh, serialize_programs=size > 1 and jax.default_backend() == "cpu")
    return mesh


def get_mesh() -> Mesh | None:
    return STATE.mesh


def align(args: list) -> list:
    """Arrays pinned to one device, in a program that also reads mesh-placed arrays, are
    replicated over the mesh first (XLA refuses to mix the two). Nothing to do without a mesh."""
    mesh = STATE.mesh
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
