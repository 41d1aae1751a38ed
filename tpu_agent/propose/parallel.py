"""What the parallelism playbooks read of a torch.distributed run: its world size (profile --nproc), whether it
runs FSDP2 (reduce-scatters measured on its ranks, or fully_shard in its source), whether the script builds a
2-D (dp, tp) mesh and whether its data follows the dp coordinate (read from its source), and the dp x tp
factorisations the model's dims allow.

`tpu-agent tune --nproc N` profiles the baseline with N ranks, so these are read from the run being tuned.
The mesh factorisations use the projection's rule (projection/rank.py: tensor sizes that divide every width of the
repeated blocks' Linear layers), so the tuner and the `--target` projection search the same meshes.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tpu_agent.plan.actions import ActivationCheckpointing, MeshShape
from tpu_agent.profilers.schema import Profile
from tpu_agent.projection import rank

# Names a script reads its place in the job with: its batches then follow its rank or dp coordinate.
RANK_READS = ("get_local_rank", "get_coordinate", "get_rank", "DistributedSampler", "RANK")


def world_size(p: Profile) -> int:
    return p.distributed.world_size if p.distributed is not None else 1


def reduce_scatters(p: Profile) -> int:
    """Reduce-scatters the ranks ran in their measured steps (FSDP2 reduce-scatters its gradients; DDP does not)."""
    if p.distributed is None:
        return 0
    return sum(c.count for r in p.distributed.ranks for c in r.collectives if c.op == "reduce_scatter")


def _tree(p: Profile) -> ast.Module | None:
    try:
        return ast.parse(Path(p.script).read_text())
    except (OSError, SyntaxError, ValueError):
        return None


def _called(node: ast.AST) -> str | None:
    func = node.func if isinstance(node, ast.Call) else None
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def uses_fsdp(p: Profile) -> int:
    """1 when the run is FSDP2: its ranks reduce-scattered gradients, or the script calls fully_shard (on a mesh
    whose dp axis has one rank FSDP2 reduces nothing)."""
    if reduce_scatters(p):
        return 1
    tree = _tree(p)
    return int(any(_called(n) == "fully_shard" for n in ast.walk(tree))) if tree is not None else 0


def _2d_mesh_shapes(p: Profile) -> list[ast.Tuple | ast.List]:
    """The two-entry shapes (tuple or list literals) the script's init_device_mesh calls give."""
    tree = _tree(p)
    found = []
    for node in ast.walk(tree) if tree is not None else ():
        if _called(node) == "init_device_mesh":
            shape = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "mesh_shape"), None)
            if isinstance(shape, (ast.Tuple, ast.List)) and len(shape.elts) == 2:
                found.append(shape)
    return found


def builds_2d_mesh(p: Profile) -> int:
    """1 when the script calls init_device_mesh with a shape of two entries (a tuple or list literal)."""
    return int(bool(_2d_mesh_shapes(p)))


def written_mesh(p: Profile) -> tuple[int, int] | None:
    """The script's 2-D mesh shape when its source writes both sizes as numbers (None: computed, or several)."""
    shapes = {tuple(e.value if isinstance(e, ast.Constant) else None for e in s.elts) for s in _2d_mesh_shapes(p)}
    if len(shapes) != 1 or None in next(iter(shapes)):
        return None
    return next(iter(shapes))


def dp_batches(p: Profile) -> bool:
    """Whether the script's batches follow its place in the job (it reads its rank or mesh coordinate); True when
    its source cannot be read (the cautious reading: another dp then changes the training)."""
    tree = _tree(p)
    if tree is None:
        return True
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return any(r in names for r in RANK_READS)


def mesh_shapes(p: Profile) -> list[tuple[int, int]]:
    """Every (dp, tp) with dp * tp the world size and tp dividing the repeated blocks' Linear widths, but the
    script's own when its source writes it in numbers."""
    world = world_size(p)
    if world < 2:
        return []
    own = written_mesh(p)
    shapes = [(world // tp, tp) for tp in rank.tensor_sizes(world, rank.tensor_dims(p.modules))]
    return [s for s in shapes if s != own]


def slice_plan(plan, world: int) -> "rank.SlicePlan | None":
    """The projection's point for a plan's parallelism (`tune --target SLICE` ranks these by projected step time,
    never by the time measured on this host): its mesh as fsdp x tensor, checkpointing on or off, the script's
    batch (FSDP over all `world` ranks when the plan keeps the script's mesh). None when the plan has no
    mesh_shape or checkpointing (FSDP2's reshard and param dtype are not part of the projection's space)."""
    mesh, ckpt = plan.of(MeshShape), plan.of(ActivationCheckpointing)
    if not mesh and not ckpt:
        return None
    if mesh:
        dp, tp = mesh[0].shape
        axes = {a: n for a, n in (("fsdp", dp), ("tensor", tp)) if n > 1} or {"fsdp": 1}
    else:
        axes = {"fsdp": world}
    return rank.SlicePlan(mesh=axes, per_chip_batch=None, checkpoint=bool(ckpt))
