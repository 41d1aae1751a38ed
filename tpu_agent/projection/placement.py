"""Where each input of the step sits on the mesh: parameters by rule (or FSDP/tensor defaults), optimizer state as
its parameter, the batch split on dim 0 over the batch axes."""

from __future__ import annotations

import fnmatch

from tpu_agent.errors import InputError

BATCH_AXES = ("data", "fsdp")
TENSOR_AXES = ("tensor", "model")
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "c_proj", "fc2", "wo", "w2", "dense_4h_to_h", "proj_out")


def data_parallel(mesh: dict[str, int], batch_axis: str | None = None) -> int:
    """How many ways the batch is split: the plan's batch axis, else the data and fsdp axes."""
    degree = 1
    for axis, size in mesh.items():
        if (axis == batch_axis) if batch_axis else axis in BATCH_AXES:
            degree *= size
    return degree


def _divides(shape, dim, size) -> bool:
    return dim < len(shape) and shape[dim] % size == 0


def default_spec(name: str, shape: tuple, mesh: dict[str, int]) -> tuple:
    """FSDP: the largest dim the `fsdp` axis divides; tensor parallel (`tensor`/`model` axis): 2-D weights split
    Megatron-style (row-parallel names on dim 1, the rest on dim 0), the FSDP axis on the other dim."""
    spec: list = [None] * len(shape)
    tensor = next((a for a in TENSOR_AXES if mesh.get(a, 1) > 1), None)
    expert = "expert" if mesh.get("expert", 1) > 1 else None
    if expert and len(shape) == 3 and _divides(shape, 0, mesh[expert]):
        spec[0] = expert
    if tensor and len(shape) >= 2:
        short = name.rsplit(".", 2)[-2] if "." in name else name
        dim = len(shape) - 1 if any(short == r or short.endswith(r) for r in ROW_PARALLEL) else len(shape) - 2
        if spec[dim] is None and _divides(shape, dim, mesh[tensor]):
            spec[dim] = tensor
    fsdp = mesh.get("fsdp", 1)
    if fsdp > 1 and len(shape) >= 1:
        order = sorted(range(len(shape)), key=lambda d: -shape[d])
        for dim in order:
            if spec[dim] is None and shape[dim] % fsdp == 0 and shape[dim] >= fsdp:
                spec[dim] = "fsdp"
                break
    return tuple(spec)


def rule_spec(name: str, shape: tuple, rules: list[tuple[str, tuple]], mesh: dict[str, int]) -> tuple | None:
    for pattern, spec in rules:
        if fnmatch.fnmatchcase(name, pattern):
            check(name, shape, spec, mesh)
            return tuple(spec) + (None,) * (len(shape) - len(spec))
    return None


def check(name: str, shape: tuple, spec, mesh: dict[str, int]) -> None:
    if len(spec) > len(shape):
        raise InputError(f"shard rule for {name}: spec {tuple(spec)} has more entries than its dims {shape}")
    for dim, axes in enumerate(spec):
        for axis in ([axes] if isinstance(axes, str) else list(axes or [])):
            if axis not in mesh:
                raise InputError(f"shard rule for {name}: mesh axis {axis!r} is not in the mesh {mesh}")
            if shape[dim] % mesh[axis]:
                raise InputError(f"{name}: dim {dim} of size {shape[dim]} does not divide by mesh axis "
                                 f"{axis}={mesh[axis]}")


def batch_spec(shape: tuple, mesh: dict[str, int], axis: str | None) -> tuple:
    if not shape:
        return ()
    axes = [axis] if axis else [a for a in mesh if a in BATCH_AXES and mesh[a] > 1]
    size = 1
    for a in axes:
        size *= mesh[a]
    if not axes or shape[0] % size:
        return (None,) * len(shape)
    return (tuple(axes) if len(axes) > 1 else axes[0],) + (None,) * (len(shape) - 1)


def spec_for(role: str, name: str | None, shape: tuple, mesh: dict[str, int], rules, batch_axis) -> tuple:
    if role == "data":
        return batch_spec(shape, mesh, batch_axis)
    if role == "buffer":
        return (None,) * len(shape)
    if role == "state":
        param = name.split(":", 2)[2]
    else:
        param = name or ""
    if not shape or (role == "state" and len(shape) == 0):
        return ()
    found = rule_spec(param, shape, rules, mesh)
    return found if found is not None else default_spec(param, shape, mesh)
