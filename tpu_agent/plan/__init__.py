"""A plan's actions, their run-time application in the child, the source rewrite and the patch."""

from tpu_agent.plan.actions import (
    ACTION_KINDS,
    Action,
    BatchSharding,
    Compile,
    MatmulPrecision,
    Mesh,
    PadDim,
    PadOps,
    Plan,
    ShardRule,
)

__all__ = ["ACTION_KINDS", "Action", "BatchSharding", "Compile", "MatmulPrecision", "Mesh", "PadDim", "PadOps", "Plan",
           "ShardRule"]
