"""The parallelism of a torch.distributed script, changed at run time in each rank's child without editing it.

A plan's parallelism actions (distributed_actions.py: FsdpReshard, FsdpParamDtype, ActivationCheckpointing,
MeshShape) set a `Parallelism` here; `install` then wraps what the script calls, before it runs:

- `torch.distributed.fsdp.fully_shard` (and its other import paths): every call gets the plan's
  `reshard_after_forward` and the plan's MixedPrecisionPolicy `param_dtype` (reduce_dtype float32 unless the script
  set one), and the modules it shards are recorded in order;
- `init_device_mesh`: a 2-D `(dp, tp)` mesh of the job's world size is built with the plan's factorisation; a mesh
  the plan cannot take (another number of dims, another size) is refused with one `error:` line, exit 2;
- at the model's first forward, its blocks (the modules the script passed to `fully_shard` that hold no other
  sharded module, else its largest list of repeated blocks) run under `torch.utils.checkpoint`, all or every k-th,
  the forward wrapped inside FSDP's hooks as TorchTitan's `apply_ac` before `apply_fsdp` has it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

MODULES_WITH_FULLY_SHARD = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp",
                            "torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp._fully_shard._fully_shard")
MODULES_WITH_MESH = ("torch.distributed.device_mesh", "torch.distributed")
DTYPES = ("bfloat16", "float32")


@dataclass
class Parallelism:
    """What the plan asks of the script's parallelism, and what the run did (for its notes)."""

    reshard_after_forward: bool | None = None
    param_dtype: str | None = None  # one of DTYPES
    checkpoint_every: int | None = None  # 1: every block; k: blocks 0, k, 2k, ...
    mesh: tuple[int, int] | None = None  # (dp, tp)
    sharded: list = field(default_factory=list)  # the modules fully_shard was called on, in order
    meshes: list[str] = field(default_factory=list)  # each mesh the plan rebuilt, as "(a, b) -> (c, d)"
    checkpointed: int = 0


def settings(applied) -> Parallelism:
    """The run's Parallelism, made at the first parallelism action."""
    if applied.parallelism is None:
        applied.parallelism = Parallelism()
    return applied.parallelism


def fsdp_kwargs(p: Parallelism, kwargs: dict) -> dict:
    """A fully_shard call's keyword arguments with the plan's reshard_after_forward and param dtype."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = dict(kwargs)
    if p.reshard_after_forward is not None:
        out["reshard_after_forward"] = p.reshard_after_forward
    if p.param_dtype is not None:
        policy = out.get("mp_policy") or MixedPrecisionPolicy()
        reduce = policy.reduce_dtype if policy.reduce_dtype is not None else torch.float32
        out["mp_policy"] = dataclasses.replace(policy, param_dtype=getattr(torch, p.param_dtype), reduce_dtype=reduce)
    return out


def mesh_refusal(p: Parallelism, shape) -> str | None:
    """Why a mesh of `shape` cannot take the plan's (dp, tp) (None: it can)."""
    dp, tp = p.mesh
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2:
        return (f"mesh_shape {dp}x{tp}: the script builds a {len(shape)}-D mesh {shape}; only a 2-D (dp, tp) mesh "
                "can be refactored")
    if shape[0] * shape[1] != dp * tp:
        return (f"mesh_shape {dp}x{tp}: the script's mesh {shape} has {shape[0] * shape[1]} ranks, the plan's "
                f"{dp * tp}")
    return None


def planned_shape(p: Parallelism, shape) -> tuple:
    """The shape a script's init_device_mesh call builds under the plan: its own 1-D meshes (FSDP2's default mesh
    over every rank among them) as they are, a 2-D one refactored; raises ValueError for one the plan cannot take."""
    if p.mesh is None or len(tuple(shape)) == 1:
        return tuple(shape)
    why = mesh_refusal(p, shape)
    if why is not None:
        raise ValueError(why)
    p.meshes.append(f"{tuple(int(d) for d in shape)} -> {p.mesh}")
    return p.mesh


def blocks_of(p: Parallelism, root) -> list:
    """The blocks to checkpoint: the modules fully_shard sharded that hold no other sharded module (the root and
    other wrappers left out), in the order sharded; without them, the root's largest list of repeated blocks."""
    ids = {id(m) for m in p.sharded}
    blocks = [m for m in p.sharded if not any(id(c) in ids for c in m.modules() if c is not m)]
    if blocks:
        return blocks
    from tpu_agent.projection.record import repeated_blocks

    found = repeated_blocks([root])
    return list(found[0]) if found is not None else []


def checkpoint_blocks(blocks: list, every: int) -> int:
    """Run blocks 0, every, 2*every, ... under non-reentrant activation checkpointing; how many."""
    import torch.utils.checkpoint

    count = 0
    for i, block in enumerate(blocks):
        if i % every:
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        count += 1
    return count


def _refuse(line: str) -> None:
    from tpu_agent.backend.distributed import faults

    faults.usage_error(line)  # `error: LINE`, exit 2, printed once by the launcher


def _patch(names: tuple[str, ...], attr: str, make) -> bool:
    """Replace `attr` in each of the modules `names` (imported) that has torch's own; False when none has it."""
    import importlib

    original, wrapper = None, None
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, attr, None)
        if current is None:
            continue
        if original is None:
            original, wrapper = current, make(current)
        if current is original:
            setattr(module, attr, wrapper)
    return original is not None


def _wrap_fully_shard(p: Parallelism):
    def make(original):
        @functools.wraps(original)
        def fully_shard(module, *args, **kwargs):
            p.sharded.extend(module if isinstance(module, (list, tuple)) else [module])
            return original(module, *args, **fsdp_kwargs(p, kwargs))

        return fully_shard

    return make


def _wrap_init_device_mesh(p: Parallelism):
    def make(original):
        @functools.wraps(original)
        def init_device_mesh(device_type, mesh_shape, *args, **kwargs):  # FSDP2 passes mesh_shape= by name
            try:
                shape = planned_shape(p, mesh_shape)
            except ValueError as exc:
                _refuse(str(exc))
                raise
            return original(device_type, shape, *args, **kwargs)

        return init_device_mesh

    return make


def install(p: Parallelism, notes: list[str]) -> None:
    """Wrap fully_shard and init_device_mesh, and checkpoint the blocks at the model's first forward."""
    import torch

    if p.reshard_after_forward is not None or p.param_dtype is not None or p.checkpoint_every is not None:
        if not _patch(MODULES_WITH_FULLY_SHARD, "fully_shard", _wrap_fully_shard(p)):
            _refuse("this PyTorch has no torch.distributed.fsdp.fully_shard: the plan's FSDP2 actions cannot apply")
    if p.mesh is not None:
        _patch(MODULES_WITH_MESH, "init_device_mesh", _wrap_init_device_mesh(p))
    state = {"handle": None}

    def first_forward(module, _args):
        if not any(True for _ in module.parameters()):
            return None
        state["handle"].remove()
        if p.checkpoint_every is not None:
            p.checkpointed = checkpoint_blocks(blocks_of(p, module), p.checkpoint_every)
        if p.mesh is not None and not p.meshes:
            _refuse(f"mesh_shape {p.mesh[0]}x{p.mesh[1]}: the script built no 2-D mesh (init_device_mesh(device, "
                    "(dp, tp))) before its first forward: its parallelism is not set by a mesh the plan can change")
        notes.append(describe(p))
        return None

    state["handle"] = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)


def describe(p: Parallelism) -> str:
    """What the run did, for its notes."""
    parts = []
    if p.reshard_after_forward is not None:
        parts.append(f"reshard_after_forward={p.reshard_after_forward}")
    if p.param_dtype is not None:
        parts.append(f"FSDP2 param_dtype {p.param_dtype}")
    if p.reshard_after_forward is not None or p.param_dtype is not None:
        parts.append(f"on {len(p.sharded)} fully_shard calls")
    if p.checkpoint_every is not None:
        parts.append(f"{p.checkpointed} blocks checkpointed (every {p.checkpoint_every})")
    if p.meshes:
        parts.append("mesh " + ", ".join(p.meshes))
    return "parallelism: " + "; ".join(parts)
