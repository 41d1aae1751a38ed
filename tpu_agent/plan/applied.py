"""What a plan's run-time actions ask of the run: each action writes its part here (its `apply`),
and runtime.py does it in the child before the script runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpu_agent.plan.parallelism import Parallelism


@dataclass
class Applied:
    """What a plan's actions asked of the run, and what was done (notes for the trial's record)."""

    notes: list[str] = field(default_factory=list)
    mesh: dict[str, int] | None = None  # the Mesh action's axes: placed on the model at its first forward
    rules: list[tuple[str, tuple]] = field(default_factory=list)
    batch_axis: str | None = None
    compile_model: bool = False
    model: str | None = None  # the module the hook found
    sharded: list[tuple[str, tuple]] = field(default_factory=list)  # parameter name -> its PartitionSpec
    parallelism: Parallelism | None = None  # a torch.distributed script's FSDP2, mesh and checkpointing changes
