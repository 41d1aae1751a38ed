"""`profile.json`: what the tuner and the agent read about a run. Versioned; see the README.

Provenance is part of the contract. Times, counts, transfers and live memory
are measured. FLOPs and bytes are counted by static analysis (XLA's cost
analysis, PyTorch's FlopCounterMode, HLO shapes). Anything that comes from a
model of a TPU (padding waste, roofline times) is an `Estimate` or lives in a
model whose `estimate` field is True, and the terminal says "estimate" beside it.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from .environment import Environment
from .recompile_schema import GraphBreaks, Recompilation, Recompiling

SCHEMA_VERSION = 1

Mode = Literal["eager", "fused", "compiled-if-available"]


class Estimate(BaseModel):
    """A number from a model of the hardware, not from a measurement."""

    estimate: Literal[True] = True
    value: float
    unit: str
    basis: str = Field(description="how it was estimated, in one line")


class Settings(BaseModel):
    steps: int | None = Field(None, description="measured steps requested (after warm-up); None: until the script ends")
    warmup: int = Field(2, description="first steps excluded from statistics (compilation)")
    mode: Mode = "fused"
    devices: int = Field(1, description="simulated CPU devices (XLA --xla_force_host_platform_device_count)")
    target: str | None = Field(None, description="TPU generation for the roofline estimate")
    padding_generation: str | None = Field(None, description="TPU generation the padding report models "
                                           "(None: --target, else the device's generation)")
    dump_hlo: bool = True
    xla_dump: bool = False
    trace_dir: str | None = None
    time_executables: bool = False
    host_device_steps: int = Field(2, ge=0, description="extra steps run after the measured ones with every "
                                   "executable launch waited for, to split host and device time (0: none)")

    def timed_steps(self) -> int:
        """Steps run for the host/device split (none with time_executables: every step is timed already)."""
        return 0 if self.time_executables else self.host_device_steps


class Device(BaseModel):
    platform: str = Field(description="JAX platform the device runs on: cpu, gpu or tpu")
    device_kind: str
    count: int = Field(description="JAX devices visible to the process")
    generation: str | None = Field(None, description="TPU generation: the real chip's, or the one the bundled device reports")
    emulated: bool = Field(description="True: the bundled device on a CPU/GPU pretends to be a TPU of `generation`")


class Peak(BaseModel):
    flops_per_s: float
    dtype: str
    measured: bool = Field(description="True: measured here by a matmul calibration; False: a datasheet figure")
    source: str


class Step(BaseModel):
    index: int = Field(description="1-based; step k ends at the k-th step marker")
    wall_s: float = Field(description="measured, device synchronized at both ends")
    compile_s: float = Field(0.0, description="measured time spent tracing, lowering and compiling inside this step")
    warmup: bool = False
    instrumented: bool = Field(False, description="FlopCounterMode ran in this step, or the profiler waited for "
                               "every launch in it (device_s): its time is not representative")
    compiled: bool = Field(False, description="something was compiled in this step")
    live_bytes: int | None = Field(None, description="device buffers alive at the step's end")
    peak_bytes: int | None = Field(None, description="measured: the most device bytes alive inside the step (the "
                                   "in-step peak: live bytes at each program launch plus its temporaries)")
    device_s: float | None = Field(None, description="measured: time in executable launches, each waited for until "
                                   "it finished; None: launches were not waited for in this step")
    launches: int | None = Field(None, description="executable launches in this step (with device_s)")
    comm_s: float | None = Field(None, description="measured: time in this rank's collectives in this step, each "
                                 "from issue to completion (waiting for the other ranks included); None: none ran")
    collectives: int | None = Field(None, description="collectives this rank ran in this step (with comm_s)")


class StepStats(BaseModel):
    count: int
    median_s: float
    p10_s: float
    p90_s: float
    mean_s: float
    basis: str = Field(description="which steps the statistics cover")


class Steps(BaseModel):
    markers: list[str] = Field(description="what marked steps: optimizer, mark_step, compiled_step; empty: none "
                               "(the whole run is one region)")
    whole_run: bool = Field(False, description="no step markers: the one region is the whole run")
    stopped_by_profiler: bool = Field(False, description="--steps reached: the script was stopped at a step boundary")
    items: list[Step] = Field(default_factory=list)
    stats: StepStats | None = None
    compile_s: float = Field(0.0, description="measured compile time over the whole run")
    compiles: int = Field(0, description="XLA compilations over the whole run")


class WarmUp(BaseModel):
    """A run's start as TorchTPU reports its benchmarks: first step, warm-up until compiling stops, steady step."""

    first_step_s: float = Field(description="measured: step 1's wall time, its tracing and compiles included")
    first_step_instrumented: bool = Field(False, description="step 1 ran under FlopCounterMode (the profiler's FLOP "
                                          "cross-check), which adds its own Python time per op")
    compiling_steps: int = Field(description="steps up to the last one that compiled (the compile count stops "
                                 "changing after it); 0: no step compiled")
    warmup_s: float = Field(description="measured: wall time of those steps")
    overhead_s: float | None = Field(None, description="warmup_s less the same number of steady steps; None: no "
                                     "steady step to compare with")
    steady_step_s: float | None = Field(None, description="measured: median of the steps after the last compiling "
                                        "step (warm-up setting ignored); None: every step compiled")
    steady_steps: int = 0
    programs_compiled: int = Field(description="XLA compilations over the whole run (each a distinct program)")
    peak_bytes: int | None = Field(None, description="measured peak device memory (the runtime's peak where it "
                                   "keeps one, else the most live buffer bytes at a step boundary)")
    peak_source: str | None = None
    live_growth_bytes_per_step: float | None = Field(None, description="measured: bytes per step by which the "
                                                     "floor of live device bytes rises over the steady steps (the "
                                                     "least of the last third against the least of the first)")
    memory_flat: bool | None = Field(None, description="live device bytes do not grow over the steady steps "
                                     "(floor rising under 1 KiB or 0.1 % of the first steady step's per step)")


class FlopCheck(BaseModel):
    """XLA's count and PyTorch's FlopCounterMode on the same region."""

    region: str = Field(description="the region both counted, e.g. 'step 1 (from the script start)'")
    xla_flops: float = Field(description="XLA cost analysis of the executables run in the region, per execution")
    xla_dot_conv_flops: float = Field(description="the dots' and convolutions' share, from HLO shapes")
    flop_counter_flops: float = Field(description="torch.utils.flop_counter.FlopCounterMode, tpu tensors only")
    flop_counter_by_op: dict[str, float] = Field(default_factory=dict)
    relative_difference: float | None = Field(
        description="xla_flops / flop_counter_flops - 1; null when FlopCounterMode counted nothing and XLA did "
        "(no ratio exists: a step with no matmul or convolution)")
    dot_conv_relative_difference: float | None = None
    xla_conv_padding_flops: float = Field(0.0, description="multiply-adds against convolutions' zero padding "
                                          "(from HLO windows): FlopCounterMode counts them, XLA's cost analysis not")
    adjusted_relative_difference: float | None = Field(
        None, description="(xla_flops + xla_conv_padding_flops) / flop_counter_flops - 1: both on one convention")
    agrees: bool = Field(description="the totals are within tolerance, on one convention (adjusted_relative_difference)")
    dot_conv_agrees: bool = Field(False, description="XLA's dots and convolutions are within tolerance of FlopCounterMode")
    tolerance: float = 0.10
    explanation: str


class Flops(BaseModel):
    per_step: float = Field(description="XLA cost analysis: FLOPs of the executables run per measured step (counted)")
    bytes_per_step: float = Field(description="XLA cost analysis: bytes accessed per measured step (counted)")
    transcendentals_per_step: float = 0.0
    dot_conv_per_step: float = Field(0.0, description="dots' and convolutions' FLOPs per step, from HLO shapes")
    achieved_flops_per_s: float | None = Field(None, description="per_step / median step time")
    peak: Peak | None = None
    mfu: float | None = Field(None, description="achieved / peak.flops_per_s")
    check: FlopCheck | None = None


class HostDevice(BaseModel):
    """Where a step's time goes, after XProf's overview: host (Python, dispatch, tracing, recording ops) or device.

    Measured on steps whose every executable launch was waited for, so host and
    device do not overlap there: device = the launches' time, host = wall - device.
    """

    steps: list[int] = Field(description="the steps measured (compile-free, every launch waited for)")
    wall_s: float = Field(description="measured: mean wall time of those steps")
    device_s: float = Field(description="measured: mean time per step in executable launches, each waited for")
    host_s: float = Field(description="measured: wall_s - device_s (Python, dispatch, tracing, recording ops, transfers)")
    host_share: float = Field(description="host_s / wall_s")
    device_share: float = Field(description="device_s / wall_s")
    launches_per_step: float = Field(description="measured: executable launches per step")
    bound: Literal["host", "compute", "memory", "device"] = Field(
        description="host: host_share > 0.5 (measured); else the device side: compute when XLA's FLOPs take at least "
        "half the device time at the measured peak, else memory by the roofline estimate of the target TPU, else "
        "device (not classified further)")
    bound_estimate: bool = Field(False, description="True: `bound` comes from the roofline model, not a measurement")
    bound_basis: str = Field(description="why `bound` is what it is, in one line")
    device_flop_utilization: float | None = Field(
        None, description="FLOPs per step (XLA cost analysis) / (peak FLOP/s x device_s): the device's busy-time MFU")
    method: str = Field(description="how it was measured, in one line")


class Memory(BaseModel):
    xla_peak_bytes: int | None = Field(None, description="largest peak of any executable run (XLA memory analysis, per device)")
    xla_peak_executable: str | None = None
    live_peak_bytes: int | None = Field(None, description="measured: most device buffer bytes alive at a step boundary")
    step_peak_bytes: int | None = Field(None, description="measured: the most device bytes alive inside any step (the "
                                        "in-step peak: live bytes at each program launch plus its temporaries)")
    live_end_bytes: int | None = Field(None, description="measured: device buffer bytes alive at the end of the run")
    device_stats: dict[str, int] = Field(default_factory=dict, description="the runtime's memory_stats(), where it has them")


class Executable(BaseModel):
    name: str
    kind: str = Field(description="eager | fused | helper | compiled")
    source: str | None = None
    ops: int = Field(0, description="aten ops inside (fused graphs, compiled steps)")
    calls: int = Field(description="executions over the whole run")
    calls_per_step: float = Field(description="executions per measured step")
    time_s: float = Field(description="host time of its calls over the whole run")
    time_is_execution: bool = Field(description="True: each call was waited for; False: dispatch time only")
    flops: float = Field(description="XLA cost analysis, per execution")
    bytes_accessed: float
    transcendentals: float = 0.0
    memory: dict[str, int] = Field(default_factory=dict, description="XLA memory analysis, bytes")
    hlo_file: str | None = None
    roofline_s: Estimate | None = None


class HotOp(BaseModel):
    executable: str
    instruction: str
    opcode: str = Field(description="dot | convolution | fusion")
    fusion_kind: str | None = None
    shape: str = Field(description="result shape")
    operands: list[str] = Field(default_factory=list, description="operand shapes of its dots/convolutions")
    contains: list[str] = Field(default_factory=list, description="dots and convolutions inside a fusion")
    flops: float = Field(description="per execution, from HLO shapes")
    flops_per_step: float
    share: float = Field(description="of the step's FLOPs")
    aten_op: str | None = None
    source: str | None = Field(None, description="the user's file:line, where known")


class PaddingDim(BaseModel):
    """An unaligned dim size, over every dot/convolution it appears in."""

    size: int
    padded_to: int = Field(description="the size rounded up to the largest multiple it needs")
    multiples: list[int] = Field(description="what its roles pad it to: the sublane count (M) or the MXU edge (K, N)")
    roles: list[str] = Field(description="M rows, K contracted, N columns")
    ops: list[str] = Field(description="the hot ops it appears in, as 'aten op @ source'")
    wasted_flops_per_step: Estimate
    share_of_padded_work: float = Field(description="estimate: its share of all padded dot/conv work")


class PaddedOp(BaseModel):
    executable: str
    instruction: str
    kind: str
    aten_op: str | None = None
    source: str | None = None
    lhs: str
    rhs: str
    m: int
    k: int
    n: int
    padded_m: int
    padded_k: int
    padded_n: int
    repeats: int = 1
    flops_per_step: float = Field(description="counted: useful FLOPs per step")
    waste: float = Field(description="estimate: share of this op's padded TPU work that is padding")
    unaligned: list[str] = Field(default_factory=list, description="e.g. 'N=50257->50304'")


class Padding(BaseModel):
    estimate: Literal[True] = True
    generation: str
    mxu: int
    model: str
    total_waste: Estimate = Field(description="FLOP-weighted share of dot/conv TPU work that is tile padding")
    dims: list[PaddingDim] = Field(default_factory=list, description="unaligned dim sizes, worst first")
    ops: list[PaddedOp] = Field(default_factory=list, description="every dot and convolution of the measured steps")
    varying_left_out: list[int] = Field(default_factory=list, description="sizes that change from step to step "
                                        "(see recompiling), left out of dims: padding them one by one fixes nothing")


class Transfers(BaseModel):
    h2d_count: int
    h2d_bytes: int
    d2h_count: int
    d2h_bytes: int
    h2d_count_per_step: float = 0.0
    h2d_bytes_per_step: float = 0.0
    d2h_count_per_step: float = 0.0
    d2h_bytes_per_step: float = 0.0


class Target(BaseModel):
    """A roofline of the measured step's executables on a TPU generation: every number an estimate."""

    estimate: Literal[True] = True
    generation: str
    peak_flops_per_s: float
    hbm_bandwidth: float
    source: str
    step_s: Estimate
    compute_s: Estimate
    memory_s: Estimate
    bound: str = Field(description="compute | memory: which side of the roofline the step sits on")
    mfu: Estimate
    assumptions: list[str] = Field(default_factory=list, description="what the estimate assumes, as the console "
                                   "labels it")


class Refused(BaseModel):
    """A file of the profile the environment refused (a full disk, a read-only folder): the profile stands without
    it, and the command says why in one line."""

    what: str = Field(description="what was being written: the HLO files, the step-time plot")
    path: str
    errno: int | None = Field(None, description="the refusal's errno (28: ENOSPC, the disk is full)")
    strerror: str | None = None

    @classmethod
    def of(cls, exc: OSError, path, what: str) -> "Refused":
        return cls(what=what, path=str(path), errno=exc.errno, strerror=exc.strerror or type(exc).__name__)


class Files(BaseModel):
    hlo_dir: str | None = None
    xla_dump_dir: str | None = None
    trace_dir: str | None = None
    plot: str | None = None
    refused: list[Refused] = Field(default_factory=list, description="files the environment refused, with the "
                                   "cause; the figures above them stand")


class ModuleSize(BaseModel):
    """Modules of one class built with the same sizes, read from the built modules (measured, not parsed)."""

    kind: str = Field(description="the class: Embedding, Linear, or a class of the script")
    sizes: dict[str, int | list[int]] = Field(description="its size attributes as built, e.g. "
                                              "{'num_embeddings': 50257, 'embedding_dim': 64}")
    count: int = Field(description="modules of this class built with these sizes")
    paths: list[str] = Field(default_factory=list, description="their paths in the model, the first few")

    def values(self) -> set[int]:
        return {v for size in self.sizes.values() for v in (size if isinstance(size, list) else [size])}

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        more = f" (+{self.count - len(self.paths)} more)" if self.count > len(self.paths) else ""
        return f"{self.kind}({args}) x{self.count}: {', '.join(self.paths)}{more}"


class ExpertsModules(BaseModel):
    """MoE experts modules of one class, with the implementation they run: Hugging Face experts modules (their
    config's), or a script's own MoE block (a router and a list of experts, "loop")."""

    kind: str
    implementation: str = Field(description="eager: a Python loop over the experts hit, each with a token count "
                                "that changes every step (a new XLA program per count); grouped_mm, batched_mm: "
                                "static shapes; loop: a script's own MoE block, its code looping over its experts "
                                "list (Mixtral-style: each expert's tokens picked with torch.where)")
    experts: int = Field(description="experts per module (0: not read)")
    count: int
    paths: list[str] = Field(default_factory=list)


class BuiltModules(BaseModel):
    """The constructor sizes of the modules in the models the script ran on tpu: what a knob's value sizes."""

    models: list[str] = Field(description="each model's class, in the order first called")
    sizes: list[ModuleSize] = Field(default_factory=list, description="identical sizes grouped, in model order")
    left_out: int = Field(0, description="groups past the limit, not listed")
    experts: list[ExpertsModules] = Field(default_factory=list, description="Hugging Face MoE experts modules")


class CollectiveStat(BaseModel):
    """One collective op over one group, on one rank, over the steps the step statistics cover: measured."""

    op: str = Field(description="all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, barrier")
    ranks: list[int] = Field(description="the group's global ranks")
    count: int = Field(description="calls in those steps")
    calls_per_step: float
    bytes: int = Field(description="their bytes together, as nccl-tests sizes a collective: the gathered output of "
                       "an all_gather, the input of the others")
    bytes_per_call: float
    bytes_per_step: float
    time_s: float = Field(description="measured: their time together, each from issue to completion on this rank "
                          "(its input waited for first; waiting for the other ranks included)")
    time_per_step_s: float
    bandwidth: float | None = Field(None, description="bytes / time_s (bytes per second; algorithm bandwidth)")


class RankProfile(BaseModel):
    """One rank of a distributed run: its own measured figures."""

    rank: int
    status: str = Field(description="its profile's status: complete, stopped, failed")
    exit_code: int | None = None
    profile: str | None = Field(None, description="its full profile.json")
    step_time: StepStats | None = None
    comm_s_per_step: float | None = Field(None, description="measured: mean time per step in collectives")
    comm_share: float | None = Field(None, description="time in collectives / wall time, over the same steps (0 to 1)")
    compute_s_per_step: float | None = Field(None, description="median of (step wall time - its collectives' time): "
                                             "the step without communication")
    live_peak_bytes: int | None = Field(None, description="measured: most device bytes alive at a step boundary")
    step_peak_bytes: int | None = Field(None, description="measured: the most device bytes alive inside any step "
                                        "(the in-step peak)")
    xla_peak_bytes: int | None = Field(None, description="largest peak of its executables (XLA memory analysis)")
    runtime_peak_bytes: int | None = Field(None, description="measured: the runtime's peak_bytes_in_use, where its "
                                           "memory_stats() has it (TPU, GPU; not the CPU)")
    collectives: list[CollectiveStat] = Field(default_factory=list)
    untimed_collectives: int = Field(0, description="collectives met inside a traced program, not timed")


class SlowestRank(BaseModel):
    rank: int
    compute_s_per_step: float | None = None
    step_s: float | None = None
    spread: float | None = Field(None, description="its time / the fastest rank's - 1, on the same basis")
    basis: str


class Distributed(BaseModel):
    """A run of several ranks (`tpu-agent profile --nproc N`): each rank's figures, gathered after the job."""

    world_size: int
    launcher: str = "torch.distributed.run"
    ranks: list[RankProfile] = Field(default_factory=list, description="in rank order, the ranks that wrote a profile")
    missing_ranks: list[int] = Field(default_factory=list, description="ranks that wrote no profile")
    step_time_s: float | None = Field(None, description="the slowest rank's median step time (the job's pace)")
    comm_share: float | None = Field(None, description="the ranks' mean share of the step in collectives")
    slowest_rank: SlowestRank | None = None
    method: str = Field("", description="how the collectives were timed, in one line")


class Profile(BaseModel):
    schema_version: int = SCHEMA_VERSION
    status: Literal["complete", "stopped", "failed"] = Field(
        description="complete: the script ended by itself; stopped: --steps reached; failed: the script raised or exited non-zero")
    exit_code: int | None = None
    error: str | None = Field(None, description="the script's exception, one line")
    created_at: datetime
    script: str
    args: list[str]
    cwd: str
    run_dir: str
    settings: Settings
    mode_used: str = Field(description="the eager mode the device ran at the end: eager, fused, compiled")
    environment: Environment | None = None
    device: Device | None = None
    steps: Steps
    flops: Flops | None = None
    host_device: HostDevice | None = Field(None, description="host overhead vs device time of a steady step (measured)")
    memory: Memory = Field(default_factory=Memory)
    parameters: int | None = Field(None, description="measured: elements of the parameters the optimizers update "
                                   "(each counted at its first step); None: no optimizer step")
    modules: BuiltModules | None = Field(None, description="the modules built, with their sizes (read at each "
                                         "model's first call on tpu); None: no model was called on tpu")
    executables: list[Executable] = Field(default_factory=list)
    hot_ops: list[HotOp] = Field(default_factory=list)
    padding: Padding | None = None
    recompilations: list[Recompilation] = Field(default_factory=list)
    recompiling: Recompiling | None = Field(None, description="set when shapes change from step to step")
    graph_breaks: GraphBreaks = Field(default_factory=GraphBreaks)
    transfers: Transfers | None = None
    fallbacks: dict[str, int] = Field(default_factory=dict, description="aten ops run on the CPU, with counts")
    device_ops: int | None = Field(None, description="aten ops dispatched to the tpu device over the whole run, "
                                   "whether or not a program ran them (None: not counted)")
    target: Target | None = None
    files: Files = Field(default_factory=Files)
    notes: list[str] = Field(default_factory=list)
    warmup: WarmUp | None = Field(None, description="first step, warm-up until compiling stops, steady step, "
                                  "programs compiled, peak memory and its growth; None: no step")
    distributed: Distributed | None = Field(None, description="a run of several ranks: per-rank step time, memory, "
                                            "collectives and communication share; the rest of the profile is rank "
                                            "0's (a rank's own profile: its entry alone)")


def write_profile(profile: Profile, path: Path) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(profile.model_dump_json(indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # nothing half-written left behind
        raise
