"""Applies a plan's run-time actions inside the child process, before the script runs.

Each action applies itself (`Action.apply`): operand padding, matmul
precision and the execution mode configure the backend at once. Sharding and
module compilation need the user's model, which the script builds: a global
forward pre-hook finds it at its first call (the outermost module holding
tpu parameters). A torch.distributed script's parallelism (FSDP2's options,
its mesh, checkpointed blocks) is changed by wrapping what it calls
(parallelism.py). Source actions (`PadDim`) were applied to a copy of the
script already (rewrite.py).
"""

from __future__ import annotations

import torch

from tpu_agent.plan.actions import Plan
from tpu_agent.plan.applied import Applied


def apply_runtime(plan: Plan) -> Applied:
    """Configure the backend for `plan`; returns what was applied."""
    applied = Applied()
    for action in plan.actions:
        action.apply(applied)
    if applied.mesh is not None:
        _install_model_hook(applied)
    if applied.parallelism is not None:
        from tpu_agent.plan import parallelism

        parallelism.install(applied.parallelism, applied.notes)
    if applied.compile_model:
        from tpu_agent.backend.compiled import auto_compile

        auto_compile.compile_steps(True)  # after the mesh hook: the model is sharded, then compiled
    return applied


def _install_model_hook(applied: Applied) -> None:
    from tpu_agent.backend.core import sharding
    from tpu_agent.backend.core.tensor import TpuTensor

    mesh, axis = applied.mesh, applied.batch_axis
    sharding.set_mesh(dict(mesh))
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
        applied.sharded = sharding.shard_module(module, applied.rules, strict=False)
        if axis is not None:
            sharding.shard_batches(module, axis)
            # This call's inputs are already bound: place them too.
            for t in sharding._tensors(args):
                if t.dim() >= 1 and not t._view_chain:
                    sharding.shard_tensor(t, (axis,))
        applied.notes.append(f"mesh {dict(mesh)}; {len(applied.rules)} shard rules; "
                             f"batch split over {axis or 'nothing'}")
        return None

    handle = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
