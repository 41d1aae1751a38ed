"""Applies a plan's run-time actions inside the child process, before the script runs.

Source actions (`PadDim`) were applied to a copy of the script already
(rewrite.py). The rest configure the backend: operand padding, matmul
precision, the execution mode, and sharding. Sharding and module compilation
need the user's model, which the script builds: a global forward pre-hook
finds it at its first call (the outermost module holding tpu parameters).
"""

from __future__ import annotations

import torch

from tpu_agent.plan.actions import BatchSharding, Compile, MatmulPrecision, Mesh, PadOps, Plan, ShardRule


def apply_runtime(plan: Plan) -> "Applied":
    """Configure the backend for `plan`; returns what was applied, for the trial's record."""
    from tpu_agent.backend import modes, padding

    applied = Applied()
    for action in plan.actions:
        if isinstance(action, PadOps):
            padding.set_multiple(action.multiple)
            applied.notes.append(f"matmul operands padded to multiples of {action.multiple}")
        elif isinstance(action, MatmulPrecision):
            modes._set_precision(modes.Precision[action.precision.upper()])
            applied.notes.append(f"matmul precision {action.precision}")
        elif isinstance(action, Compile) and action.mode in ("fused", "compiled"):
            modes._set_mode(modes.EagerMode.DEFER_AND_FUSE)
            applied.notes.append("fused execution (DEFER_AND_FUSE)")
    mesh = plan.mesh
    compile_model = any(isinstance(a, Compile) and a.mode == "compiled" for a in plan.actions)
    if mesh is not None or compile_model:
        _install_model_hook(plan, mesh, compile_model, applied)
    return applied


class Applied:
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.sharded: list[tuple[str, tuple]] = []
        self.model: str | None = None


def _install_model_hook(plan: Plan, mesh: Mesh | None, compile_model: bool, applied: Applied) -> None:
    from tpu_agent.backend import sharding
    from tpu_agent.backend.compile import CompiledModule
    from tpu_agent.backend.tensor import TpuTensor

    if mesh is not None:
        sharding.set_mesh(dict(mesh.axes))
    rules = [(r.pattern, tuple(r.spec)) for r in plan.of(ShardRule)]
    batch = plan.of(BatchSharding)
    state = {"done": False}

    def first_forward(module, args):
        if state["done"]:
            return None
        params = list(module.parameters())
        if not params or not isinstance(params[0], TpuTensor):
            return None
        state["done"] = True  # the first tpu module called is the outermost one
        handle.remove()
        applied.model = type(module).__name__
        if mesh is not None:
            applied.sharded = sharding.shard_module(module, rules, strict=False)
            if batch:
                sharding.shard_batches(module, batch[0].axis)
                # This call's inputs are already bound: place them too.
                for t in sharding._tensors(args):
                    if t.dim() >= 1 and not t._view_chain:
                        sharding.shard_tensor(t, (batch[0].axis,))
            applied.notes.append(f"mesh {dict(mesh.axes)}; {len(rules)} shard rules; "
                                 f"batch split over {batch[0].axis if batch else 'nothing'}")
        if compile_model:
            compiled = CompiledModule(module, call=type(module).forward.__get__(module))
            module.forward = compiled.forward
            applied.notes.append(f"{type(module).__name__} compiled: forward and backward programs")
        return None

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
