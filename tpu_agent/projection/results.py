"""What a projection reads and reports, as pydantic models (projection.json)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Collective(BaseModel):
    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute
    result_bytes: int  # per chip
    group_size: int
    groups: int
    axes: list[str]  # the mesh axes its replica groups span
    name: str = ""
    example_group: list[int] = Field(default_factory=list)
    seconds: float = 0.0  # costed over the torus (cost.py)
    dcn: bool = False  # across slices over the data-center network (modelled by cost.py, not traced)


class Traced(BaseModel):
    """One partitioned program (the step with `blocks` repeated blocks), per chip."""

    blocks: int | None
    flops: float  # XLA cost analysis, per chip
    dot_flops: float  # dots and convolutions in the partitioned HLO, per chip
    dot_padding_flops: float = 0.0  # what the MXU spends on tile padding of the dots outside attention (cost.py)
    attention_dot_flops: float = 0.0  # of dot_flops, the attention lowering's dots
    attention_padding_flops: float = 0.0  # their tile padding on the MXU (not charged: docs/projection.md)
    bytes_accessed: float
    dot_bytes: float
    attention_bytes: float = 0.0  # bytes the attention lowering's non-dot ops move (on chip in a flash kernel)
    convert_bytes: float = 0.0  # bytes of XLA:CPU's float-width conversions (bf16 computed in f32; none on a TPU)
    collective_bytes: float = 0.0  # bytes of the collectives' buffers (costed over ICI, not as HBM traffic)
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int  # XLA:CPU's temporaries: its unfused buffers (attention's scores among them), not a TPU's
    saved_bytes: int = 0  # activations backward reads from forward, per chip (by the batch split), held in HBM
    host_saved_bytes: int = 0  # of those, the blocks' inputs held in host memory (offloaded), per chip
    param_bytes: float = 0.0  # the parameters per chip as placed (their gradients: a data-parallel all-reduce's size)
    fsdp_state_bytes: float = 0.0  # parameters and optimizer state per chip split over the fsdp axis
    fsdp_param_bytes: float = 0.0  # of those, the parameters
    model_flops: float  # whole step, all chips: 3 x forward matmul FLOPs (the MFU convention)
    collectives: list[Collective]
    compile_s: float
    ops: int


class Partitioned(BaseModel):
    """What the child read: the traced programs and how they were placed."""

    slice: str
    generation: str
    chips: int
    mesh: dict[str, int]
    blocks_total: int | None
    blocks_name: str | None
    programs: list[Traced]
    placements: dict[str, list]  # parameter name -> spec (first few)
    notes: list[str] = Field(default_factory=list)
    record_s: float = 0.0
    offload_block_inputs: bool = False  # the repeated blocks' inputs held in host memory between forward and backward
    traced_mesh: dict[str, int] | None = None  # set when re-costed from a trace on this mesh (remesh.py), else None


class Projection(BaseModel):
    """The step on the slice, per chip, as the cost model projects it: every figure an estimate, no TPU ran."""

    estimate: Literal[True] = Field(True, description="always true: projected by a model, never measured")
    label: str = Field("", description='"projected for <slice>"')
    slice: str
    read_as: str = Field("", description="how the --target (and --chips) was read: chips, TensorCores, torus")
    generation: str
    chips: int
    mesh: dict[str, int]
    step_s: float
    compute_s: float
    memory_s: float
    collective_s: float
    exposed_collective_s: float
    dcn_s: float = Field(0.0, description="of collective_s, the collectives across slices over DCN (multislice)")
    bound: str = ""  # what sets the step time: compute, memory, overlapped collectives or critical collectives
    collective_by_axis: dict[str, float]
    collective_bytes_by_kind: dict[str, float]
    flops_per_chip: float
    dot_flops_per_chip: float
    model_flops: float
    mfu: float
    hbm_bytes_per_chip: float  # arguments + outputs - aliased + saved activations
    xla_cpu_bytes_per_chip: float = 0.0  # XLA:CPU's own memory analysis (its temporaries in place of the saved)
    hbm_capacity: float
    fits: bool
    memory_margin_bytes: float = Field(0.0, description="HBM per chip less the projected need: negative when over")
    host_offload_bytes_per_chip: float = Field(0.0, description="activations held in host memory (offloaded blocks' "
                                               "inputs), per chip")
    host_transfer_s: float = Field(0.0, description="their copies to the host and back over the host link, "
                                   "overlapped with compute (what exceeds it is exposed)")
    collectives: list[Collective]
    assumptions: list[str]
    sources: list[str]
