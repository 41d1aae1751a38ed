"""What `tpu-agent project` prints: every figure labelled "projected for <slice>", the assumptions listed."""

from __future__ import annotations

from tpu_agent.projection.results import Partitioned, Projection


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _s(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 10 else f"{t:.2f} s"


def _bound(p: Projection) -> str:
    if p.bound == "overlapped collectives":
        return (f"the data/fsdp collectives, longer than compute + other memory traffic "
                f"({_s(p.compute_s + p.memory_s)}): a floor, a larger per-chip batch adds no step time until its "
                "compute reaches them")
    return {"compute": "compute (dots on the MXU)", "memory": "other memory traffic (non-dot ops through HBM)",
            "critical collectives": "collectives on the critical path (tensor/expert axes)",
            "host offload": "the copies of offloaded activations over the host link"}.get(p.bound, p.bound or "-")


def render(partitioned: Partitioned, p: Projection, wall_s: float | None = None) -> str:
    label = f"projected for {p.slice}"
    mesh = ",".join(f"{k}={v}" for k, v in p.mesh.items())
    share = p.exposed_collective_s / p.step_s if p.step_s else 0.0
    lines = [
        f"projection of the training step on {p.slice} ({p.chips} chips, TPU {p.generation}), mesh {mesh}: an estimate, "
        "no TPU ran",
        *([f"  slice             {p.read_as}"] if p.read_as else []),
        f"  memory per chip   {_bytes(p.hbm_bytes_per_chip)} of {_bytes(p.hbm_capacity)} HBM: "
        f"{'fits' if p.fits else 'does NOT fit'} ({_bytes(abs(p.memory_margin_bytes))} "
        f"{'free' if p.fits else 'over'})  ({label}; arguments + outputs - aliased + activations saved for backward; "
        f"working buffers not counted; XLA:CPU's own analysis {_bytes(p.xla_cpu_bytes_per_chip)})",
        *([f"  host memory       {_bytes(p.host_offload_bytes_per_chip)} per chip of offloaded block inputs, "
           f"{_s(p.host_transfer_s)} of copies over the host link, beside compute  ({label})"]
          if p.host_offload_bytes_per_chip else []),
        f"  step time         {_s(p.step_s)}  ({label}: compute {_s(p.compute_s)}, other memory traffic "
        f"{_s(p.memory_s)}, collectives {_s(p.collective_s)} of which exposed {_s(p.exposed_collective_s)})",
        f"  bound by          {_bound(p)}  ({label})",
        f"  MFU               {p.mfu:.1%}  ({label}; model FLOPs {p.model_flops:.3g} per step over {p.chips} chips)",
        f"  communication     {share:.1%} of the step exposed  ({label})",
        f"  FLOPs per chip    {p.flops_per_chip:.3g}, of which dots {p.dot_flops_per_chip:.3g}  ({label}; XLA cost "
        "analysis of the partitioned program)",
    ]
    if p.collective_by_axis:
        lines.append(f"  collectives by mesh axis ({label}):")
        for axis, t in sorted(p.collective_by_axis.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {axis:<16} {_s(t)}")
    if p.collective_bytes_by_kind:
        lines.append(f"  collective bytes per chip by kind ({label}):")
        for kind, b in sorted(p.collective_bytes_by_kind.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {kind:<18} {_bytes(b)}")
    top = sorted(p.collectives, key=lambda c: -c.seconds)[:8]
    if top:
        lines.append(f"  largest collectives (one traced block program; {label}):")
        for c in top:
            lines.append(f"    {c.kind:<18} {_bytes(c.result_bytes):>11}  group {c.group_size:>4} x {c.groups:<4} "
                         f"axes {'+'.join(c.axes) or '-':<12} {_s(c.seconds)}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in p.assumptions]
    lines.append("sources: " + "; ".join(p.sources))
    traced = ", ".join(f"{t.blocks if t.blocks is not None else 'all'} block(s): {t.ops} ops, compiled in "
                       f"{t.compile_s:.1f} s" for t in partitioned.programs)
    lines.append(f"traced on meta in {partitioned.record_s:.1f} s; {traced}" +
                 (f"; {wall_s:.1f} s in all" if wall_s is not None else ""))
    return "\n".join(lines)
