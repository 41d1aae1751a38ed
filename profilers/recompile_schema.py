"""profile.json's account of programs compiled again: each recompilation, the shapes that change from step to
step (batch dims, programs, declared bounds) and the fused graphs cut mid-step. Apart from schema.py so that the
profile's contract stays readable; schema.py's `Profile` holds them."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Recompilation(BaseModel):
    step: int | None = Field(description="the step it happened in; None: outside steps")
    executable: str
    kind: str
    shapes: list[str] = Field(default_factory=list, description="fused: input shapes new since the previous "
                              "graph; eager: the new executable's argument shapes")
    reason: str
    compile_s: float | None = None


class VaryingDim(BaseModel):
    """A dim of a batch tensor that took several sizes: the lengths a fix pads."""

    tensor: str = Field(description="its path in the batch: ['input_ids'], [0]; '' for a bare tensor")
    dim: int
    sizes: list[int] = Field(description="the sizes seen, ascending")
    by_batch: list[int] = Field(default_factory=list, description="its size in each batch, in order (first 200)")
    dtype: str = ""
    rows: list[int] = Field(default_factory=list, description="the batch sizes (dim 0) seen with it")
    pad_value: float | None = Field(None, description="what fills the padded rows' last position")
    pad_value_seen: bool = Field(False, description="True: observed in the batches; False: assumed from its name")


class ProgramShapes(BaseModel):
    """One program compiled for several input shapes (the same ops; eager: the same aten op)."""

    program: str = Field(description="its first executable's name")
    kind: str
    shapes: int = Field(description="how many shapes it was compiled for")
    varying: list[str] = Field(default_factory=list, description="'arg 0 dim 1: 17, 23, 31': the inputs' dims "
                               "that differ between its shapes, with the sizes seen")
    compile_s: float | None = Field(None, description="seconds compiling its shapes, where measured (fused graphs)")


class DimBound(BaseModel):
    """A dim the script declares dynamic, with bounds (`mark_dynamic(x, dim, min, max)`, torch._dynamo's or
    TorchTPU's): the lengths it says may come, so buckets cover them."""

    dim: int
    min: int | None = None
    max: int | None = None
    source: str = Field(description="file:line of the call")


class Recompiling(BaseModel):
    """Shapes that change from step to step, so that programs compile again and again."""

    verdict: str = Field(description="one line: 'recompiling: 21 shapes of dim 1 in 30 steps, 62 % of the run "
                         "compiling'")
    steps: int
    compiling_steps: int = Field(description="measured steps that compiled something")
    compile_s: float = Field(description="seconds compiling, every step")
    run_s: float = Field(description="seconds of every step together")
    compile_share: float
    batch_dims: list[VaryingDim] = Field(default_factory=list, description="batch dims that vary, where a "
                                         "DataLoader yields the batches")
    programs: list[ProgramShapes] = Field(default_factory=list)
    sources: list[str] = Field(default_factory=list, description="where the lengths are made: the collate "
                               "function, padding calls in the script, the line that copies the batch to the device")
    bounds: list[DimBound] = Field(default_factory=list, description="dims the script marks dynamic with bounds")


class GraphBreakSite(BaseModel):
    op: str | None = Field(description="what needed a concrete value: an aten op with a data-dependent output "
                           "shape, Tensor.item(), a copy to the CPU")
    reason: str = Field(description="data-dependent shape | value read on the host | graph size limit")
    source: str | None = Field(description="file:line of the code that ran it (a model's own file counts)")
    count: int
    first_step: int | None = None


class GraphBreaks(BaseModel):
    """Fused graphs cut mid-step: each break runs what was recorded and starts a new graph."""

    count: int = 0
    per_step: float = Field(0.0, description="in the measured steps")
    sites: list[GraphBreakSite] = Field(default_factory=list, description="most frequent first")
