"""The actions a torch.distributed script's own calls take: FSDP2's resharding and parameter dtype, activation
checkpointing of its blocks, and the shape of its 2-D device mesh. Each is applied in the child through
`tpu_agent.plan.parallelism.settings`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from tpu_agent.plan.action_base import ActionBase, Group
from tpu_agent.plan.applied import Applied



class FsdpReshard(ActionBase):
    """FSDP2's `reshard_after_forward` on every `fully_shard` call of a torch.distributed script: True frees each
    block's gathered parameters after its forward and gathers them again for its backward; False keeps them from
    forward to backward (one all-gather per block per step instead of two, the block's full parameters held)."""

    group: ClassVar[Group] = "sharding"
    effect: Literal["exact"] = "exact"
    hint: ClassVar[str] = "{reshard: true|false}"
    kind: Literal["fsdp_reshard_after_forward"] = "fsdp_reshard_after_forward"
    reshard: bool

    def describe(self) -> str:
        return f"FSDP2 reshard_after_forward={self.reshard}"

    def effect_note(self) -> str:
        return ("memory per rank: the gathered parameters of every block are freed after its forward (less memory, "
                "a second all-gather in backward)" if self.reshard else "memory per rank: every block's gathered "
                "parameters are held from its forward to its backward (more memory, one all-gather fewer per block)")

    def instruction(self) -> str:
        return f"`fully_shard(module, reshard_after_forward={self.reshard})` on each `fully_shard` call"

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.parallelism import settings

        settings(applied).reshard_after_forward = self.reshard


class FsdpParamDtype(ActionBase):
    """The dtype FSDP2 gathers parameters in and computes with (MixedPrecisionPolicy param_dtype); gradients are
    still reduced in float32 unless the script set its own reduce_dtype."""

    group: ClassVar[Group] = "precision"
    effect: Literal["numerics"] = "numerics"
    hint: ClassVar[str] = "{param_dtype: bfloat16|float32}"
    kind: Literal["fsdp_param_dtype"] = "fsdp_param_dtype"
    param_dtype: Literal["bfloat16", "float32"]

    def describe(self) -> str:
        return f"FSDP2 param_dtype {self.param_dtype}"

    def instruction(self) -> str:
        return (f"`fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.{self.param_dtype}, "
                "reduce_dtype=torch.float32))` on each `fully_shard` call")

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.parallelism import settings

        settings(applied).param_dtype = self.param_dtype


class ActivationCheckpointing(ActionBase):
    """The model's blocks (those the script passes to `fully_shard`, else its largest list of repeated blocks) run
    under `torch.utils.checkpoint`: backward recomputes a block's forward instead of keeping its activations.
    `every`: 1 checkpoints every block, k every k-th (blocks 0, k, 2k, ...)."""

    group: ClassVar[Group] = "execution"
    effect: Literal["exact"] = "exact"
    hint: ClassVar[str] = "{every: 1 (every block) or k (every k-th block)}"
    kind: Literal["activation_checkpointing"] = "activation_checkpointing"
    every: int = Field(1, ge=1, le=64)

    def describe(self) -> str:
        return "activation checkpointing of " + ("every block" if self.every == 1 else f"one block in {self.every}")

    def effect_note(self) -> str:
        return "memory per rank: a checkpointed block keeps only its input for backward, and recomputes its forward"

    def instruction(self) -> str:
        which = "each block" if self.every == 1 else f"blocks 0, {self.every}, {2 * self.every}, ..."
        return (f"wrap {which} before `fully_shard`: `block = checkpoint_wrapper(block)` "
                "(torch.distributed.algorithms._checkpoint.checkpoint_wrapper), or call "
                "`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` in the model's forward")

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.parallelism import settings

        settings(applied).checkpoint_every = self.every


class MeshShape(ActionBase):
    """The script's 2-D `init_device_mesh(device, (dp, tp), ...)` built with `shape` = (dp, tp) instead (the same
    world size). Tensor-parallel ranks compute the same math split another way; `dp_batches`: the script reads one
    batch per dp coordinate (its data follows the mesh), so another dp trains on another global batch (training);
    false: every rank reads the same batch, the same math (exact)."""

    group: ClassVar[Group] = "sharding"
    hint: ClassVar[str] = "{shape: [dp, tp], dp_batches (the script reads one batch per dp coordinate)}"
    kind: Literal["mesh_shape"] = "mesh_shape"
    shape: tuple[int, int]
    dp_batches: bool = True
    effect: Literal["exact", "training"] = "training"

    effect_from: ClassVar = ("dp_batches", lambda dp_batches: "training" if dp_batches else "exact")

    @field_validator("shape")
    @classmethod
    def _positive(cls, shape):
        if min(shape) < 1:
            raise ValueError("mesh_shape sizes must be positive")
        return shape

    def describe(self) -> str:
        return f"mesh dp {self.shape[0]} x tp {self.shape[1]}"

    def effect_note(self) -> str:
        if self.dp_batches:
            return (f"each of the {self.shape[0]} dp coordinates reads its own batch: the global batch is "
                    f"{self.shape[0]} per-rank batches, so training changes with dp; the losses were held to the loss "
                    "tolerance")
        return "every rank reads the same batch: the same math split another way over the ranks"

    def instruction(self) -> str:
        return f"`init_device_mesh(device, {tuple(self.shape)}, mesh_dim_names=(\"dp\", \"tp\"))`"

    def apply(self, applied: Applied) -> None:
        from tpu_agent.plan.parallelism import settings

        settings(applied).mesh = tuple(self.shape)
