"""From executables that ran to the profile's tables: step statistics, hot ops, padding, roofline.

Pure functions over plain data, so they are tested without running a script.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tpu_agent.backend.core.generations import GENERATIONS

from . import hlo, padding
from .schema import Estimate, HostDevice, HotOp, PaddedOp, Padding, PaddingDim, Step, StepStats, Target


@dataclass
class ExeInfo:
    """One executable that ran, with its analyses and how often it ran in the measured window."""

    name: str
    kind: str
    source: str | None
    calls_per_step: float
    flops: float
    bytes_accessed: float
    ops: list[hlo.HotOp] = field(default_factory=list)  # top-level dots, convolutions, fusions

    def origin(self, op: hlo.HotOp) -> tuple[str | None, str | None]:
        """The aten op and source line: HLO metadata (fused graphs), else the executable's own (eager)."""
        if op.aten_op:
            return op.aten_op, op.source or self.source
        if self.kind == "eager":
            return self.name, self.source
        return None, self.source

    @property
    def dot_conv_flops(self) -> float:
        return sum(c.flops for op in self.ops for c in op.contractions)

    @property
    def conv_padding_flops(self) -> float:
        return sum(c.padding_flops for op in self.ops for c in op.contractions)


# ----------------------------------------------------------------------------- steps


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def steady_steps(steps: list[Step]) -> tuple[list[Step], str]:
    """The steps the statistics cover, and which they are: after warm-up, not instrumented, nothing compiled
    in them. Falls back, saying so, to measured steps that compiled, then to warm-up steps, then to every step."""
    choices = [
        ([s for s in steps if not s.warmup and not s.instrumented and not s.compiled],
         "measured steps after warm-up, excluding steps that compiled or were instrumented"),
        ([s for s in steps if not s.warmup and not s.instrumented],
         "measured steps after warm-up, including steps that compiled (no step was compile-free)"),
        ([s for s in steps if not s.instrumented],
         "every step but the instrumented one, warm-up included (no step after warm-up)"),
        (steps, "all steps, warm-up and the FlopCounterMode step included (no other step)"),
    ]
    for chosen, basis in choices:
        if chosen:
            return chosen, basis
    return [], ""


def step_stats(steps: list[Step]) -> StepStats | None:
    """Statistics over the steady steps (`steady_steps`)."""
    chosen, basis = steady_steps(steps)
    if not chosen:
        return None
    times = [s.wall_s for s in chosen]
    return StepStats(count=len(times), median_s=percentile(times, 0.5), p10_s=percentile(times, 0.1),
                     p90_s=percentile(times, 0.9), mean_s=sum(times) / len(times), basis=basis)


# ----------------------------------------------------------------------------- hot ops


def _fmt_operands(op: hlo.HotOp) -> tuple[list[str], list[str]]:
    operands, contains = [], []
    for c in op.contractions:
        contains.append(f"{c.kind} {c.lhs} x {c.rhs} -> {c.out}")
        if len(op.contractions) == 1:
            operands = [str(c.lhs), str(c.rhs)]
    return operands, contains


def hot_ops(infos: list[ExeInfo], step_flops: float, limit: int = 25) -> list[HotOp]:
    """Dots, convolutions and fusions of the measured step, most FLOPs first."""
    rows = []
    for info in infos:
        if info.calls_per_step <= 0:
            continue
        for op in info.ops:
            per_step = op.flops * info.calls_per_step
            if per_step <= 0:
                continue
            aten_op, source = info.origin(op)
            operands, contains = _fmt_operands(op)
            rows.append(HotOp(
                executable=info.name, instruction=op.name, opcode=op.opcode, fusion_kind=op.fusion_kind,
                shape=op.shape, operands=operands, contains=contains if op.opcode == "fusion" else [],
                flops=op.flops, flops_per_step=per_step,
                share=per_step / step_flops if step_flops else 0.0, aten_op=aten_op, source=source,
            ))
    rows.sort(key=lambda r: -r.flops_per_step)
    return rows[:limit]


# ----------------------------------------------------------------------------- padding


def contraction_waste(c: hlo.Contraction, tiling: padding.Tiling) -> padding.MatmulWaste:
    bits = c.lhs.bits
    if c.kind == "dot":
        d = c.dot_dims
        return padding.dot_waste(c.lhs.dims, c.rhs.dims, d["lhs_contracting"], d["rhs_contracting"],
                                 d["lhs_batch"], d["rhs_batch"], tiling=tiling, bits=bits)
    v = c.conv
    return padding.conv_waste(v["out_batch"], v["out_spatial"], v["in_features"], v["out_features"],
                              v["window"], v["groups"], tiling=tiling, bits=bits)


MODEL = ("matmul (M x K) @ (K x N): K and N padded to the MXU edge, M (rows streamed) to the sublane "
         "count (8 for 32-bit, 16 for 16-bit, 32 for 8-bit); convolutions as matmuls of (batch x positions) "
         "by input features by output features per kernel position; work in multiply-adds")


def padding_report(infos: list[ExeInfo], generation: str) -> Padding:
    tiling = padding.Tiling.of(generation)
    ops: list[PaddedOp] = []
    total_useful = total_padded = 0.0
    dims: dict[int, dict] = {}
    for info in infos:
        if info.calls_per_step <= 0:
            continue
        for op in info.ops:
            aten_op, source = info.origin(op)
            where = f"{aten_op or op.name} @ {source}" if source else (aten_op or op.name)
            for c in op.contractions:
                w = contraction_waste(c, tiling)
                per_step = info.calls_per_step
                total_useful += w.useful * per_step
                total_padded += w.padded * per_step
                m, k, n = w.dims
                unaligned = [f"{d.role}={d.minor}->{_round(d)}" for d in w.dims if not d.aligned]
                ops.append(PaddedOp(
                    executable=info.name, instruction=op.name, kind=c.kind, aten_op=aten_op, source=source,
                    lhs=str(c.lhs), rhs=str(c.rhs), m=m.size, k=k.size, n=n.size,
                    padded_m=m.padded, padded_k=k.padded, padded_n=n.padded, repeats=w.repeats,
                    flops_per_step=2.0 * w.useful * per_step, waste=w.waste, unaligned=unaligned,
                ))
                shares = w.attribution()
                for d in w.dims:
                    if d.aligned or d.role not in shares:
                        continue
                    entry = dims.setdefault(d.minor, {"roles": set(), "multiples": set(), "ops": set(), "wasted": 0.0})
                    entry["roles"].add(d.role)
                    entry["multiples"].add(d.multiple)
                    entry["ops"].add(where)
                    entry["wasted"] += shares[d.role] * per_step
    dim_rows = [
        PaddingDim(
            size=size, padded_to=padding.round_up(size, max(e["multiples"])), multiples=sorted(e["multiples"]),
            roles=sorted(e["roles"]), ops=sorted(e["ops"]),
            wasted_flops_per_step=Estimate(value=2.0 * e["wasted"], unit="FLOP/step",
                                           basis=f"padding model on TPU {tiling.generation}"),
            share_of_padded_work=e["wasted"] / total_padded if total_padded else 0.0,
        )
        for size, e in dims.items()
    ]
    dim_rows.sort(key=lambda r: -r.wasted_flops_per_step.value)
    ops.sort(key=lambda o: -o.flops_per_step)
    waste = 1.0 - total_useful / total_padded if total_padded else 0.0
    return Padding(
        generation=tiling.generation, mxu=tiling.mxu, model=MODEL,
        total_waste=Estimate(value=waste, unit="share of dot/conv work",
                             basis=f"FLOP-weighted over {len(ops)} dots/convolutions, TPU {tiling.generation} tiles"),
        dims=dim_rows, ops=ops,
    )


def _round(d: padding.Dim) -> int:
    return padding.round_up(d.minor, d.multiple)


# ----------------------------------------------------------------------------- roofline


def roofline(infos: list[ExeInfo], generation: str, step_flops: float) -> Target:
    """Each executable at max(compute, memory) time on the target; padded dot/conv work on the MXU."""
    gen = GENERATIONS[generation]
    tiling = padding.Tiling.of(gen)
    compute = memory = step = 0.0
    for info in infos:
        if info.calls_per_step <= 0:
            continue
        extra = sum(2.0 * (w.padded - w.useful) for op in info.ops for w in
                    (contraction_waste(c, tiling) for c in op.contractions))
        c = (info.flops + extra) / gen.peak_bf16_flops
        m = info.bytes_accessed / gen.hbm_bandwidth
        compute += c * info.calls_per_step
        memory += m * info.calls_per_step
        step += max(c, m) * info.calls_per_step
    basis = f"roofline on TPU {gen.name}: max(FLOPs incl. tile padding / peak bf16, bytes accessed / HBM bandwidth) per executable"
    mfu = step_flops / (step * gen.peak_bf16_flops) if step > 0 else 0.0
    return Target(
        generation=gen.name, peak_flops_per_s=gen.peak_bf16_flops, hbm_bandwidth=gen.hbm_bandwidth,
        source=gen.source,
        step_s=Estimate(value=step, unit="s", basis=basis),
        compute_s=Estimate(value=compute, unit="s", basis="FLOPs incl. tile padding / peak bf16"),
        memory_s=Estimate(value=memory, unit="s", basis="XLA bytes accessed / HBM bandwidth"),
        bound="compute" if compute >= memory else "memory",
        mfu=Estimate(value=mfu, unit="fraction", basis="step FLOPs / (estimated step time x peak); "
                     "no launch, host or communication overhead modelled"),
        assumptions=[
            f"one TPU {gen.name} chip: {gen.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 peak, HBM "
            f"{gen.hbm_bandwidth / 1e12:.2f} TB/s ({gen.source})",
            f"each executable at max(FLOPs with K and N padded to the {tiling.mxu}-wide MXU, M to the sublanes / peak, "
            "bytes accessed / HBM bandwidth), summed over the step",
            "FLOPs and bytes from XLA's compile of the step for this host, not a TPU compile",
            "no launch, host, input-pipeline or interconnect time",
        ],
    )


# ----------------------------------------------------------------------------- host vs device

HOST_BOUND = 0.5  # host share above which a step is host-bound
COMPUTE_BOUND = 0.5  # device FLOP utilization at or above which the device side is compute-bound


def host_device(steps: list[Step], flops_per_step: float, peak_flops_per_s: float | None,
                roofline: Target | None) -> HostDevice | None:
    """Host overhead vs device time over the steps whose launches were all waited for and that compiled nothing.

    Steps of the FlopCounterMode region carry no device_s, so they never count here.
    """
    used = [s for s in steps if s.device_s is not None and not s.warmup and not s.compiled and s.wall_s > 0]
    if not used:
        return None
    n = len(used)
    wall = sum(s.wall_s for s in used) / n
    device = min(sum(s.device_s for s in used) / n, wall)  # the launches run inside the step
    host = wall - device
    host_share = host / wall
    util = flops_per_step / (peak_flops_per_s * device) if peak_flops_per_s and device > 0 else None
    estimate = False
    if host_share > HOST_BOUND:
        bound, basis = "host", (f"{host_share:.0%} of the step is host time (measured): the device waits for "
                                "Python, dispatch and tracing")
    elif util is not None and util >= COMPUTE_BOUND:
        bound, basis = "compute", (f"the device time is mostly arithmetic: XLA's FLOPs at the measured peak take "
                                   f"{util:.0%} of it")
    elif roofline is not None and roofline.bound == "memory":
        bound, estimate = "memory", True
        basis = (f"on the device the FLOPs take {util:.0%} of its time at the measured peak; the roofline of TPU "
                 f"{roofline.generation} puts the step on the memory side (estimate: bytes "
                 f"{roofline.memory_s.value * 1e3:.3g} ms vs FLOPs {roofline.compute_s.value * 1e3:.3g} ms)"
                 if util is not None else
                 f"the roofline of TPU {roofline.generation} puts the step on the memory side (estimate)")
    else:
        bound = "device"
        basis = ("device time dominates; " + (f"its FLOPs take {util:.0%} of it at the measured peak, " if util is not None
                                              else "") + "not classified further")
    launches = sum(s.launches or 0 for s in used) / n
    return HostDevice(
        steps=[s.index for s in used], wall_s=wall, device_s=device, host_s=host, host_share=host_share,
        device_share=device / wall, launches_per_step=launches, bound=bound, bound_estimate=estimate,
        bound_basis=basis, device_flop_utilization=util,
        method=("measured on steps whose every executable launch was waited for (host and device do not overlap "
                "there): device = the launches' time, host = wall - device; a launch's time includes JAX's "
                "dispatch of the call, so device time is slightly high and host share a lower bound"),
    )
