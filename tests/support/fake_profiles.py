"""Small, hand-built Profile objects for tests of what reads profiles (knobs, diff)."""

from __future__ import annotations

from datetime import datetime, timezone

from tpu_agent.profilers.schema import (
    Device,
    Estimate,
    Flops,
    HotOp,
    Memory,
    Padding,
    PaddingDim,
    Profile,
    Settings,
    Step,
    Steps,
    StepStats,
)


def hot_op(lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...], share: float, flops: float = 1e9) -> HotOp:
    def s(shape):
        return f"f32[{','.join(map(str, shape))}]"

    return HotOp(executable="fused_graph_1", instruction=f"dot.{lhs}{rhs}", opcode="dot", shape=s(out),
                 operands=[s(lhs), s(rhs)], flops=flops, flops_per_step=flops, share=share,
                 aten_op="aten.mm.default", source="train.py:10")


def padding_dim(size: int, padded_to: int, share: float) -> PaddingDim:
    return PaddingDim(size=size, padded_to=padded_to, multiples=[128], roles=["K"], ops=["aten.mm @ train.py:10"],
                      wasted_flops_per_step=Estimate(value=1e6, unit="FLOP/step", basis="test"),
                      share_of_padded_work=share)


def make_profile(
    *,
    script: str = "/x/train.py",
    step_s: float = 0.050,
    steps_measured: int = 5,
    flops: float = 2e9,
    mfu: float | None = 0.2,
    xla_peak: int | None = 100 << 20,
    live_peak: int | None = 300 << 20,
    waste: float | None = 0.04,
    hot_ops: list[HotOp] | None = None,
    padding_dims: list[PaddingDim] | None = None,
    device_kind: str = "cpu",
) -> Profile:
    items = [Step(index=i + 1, wall_s=step_s) for i in range(steps_measured)]
    padding = None
    if waste is not None:
        padding = Padding(generation="v5e", mxu=128, model="test",
                          total_waste=Estimate(value=waste, unit="share", basis="test"),
                          dims=padding_dims or [])
    return Profile(
        status="stopped", exit_code=0, created_at=datetime.now(timezone.utc), script=script, args=[], cwd="/x",
        run_dir="/x/.tpu-agent/runs/r", settings=Settings(), mode_used="fused",
        device=Device(platform="cpu", device_kind=device_kind, count=1, emulated=True, generation="v5e"),
        steps=Steps(markers=["optimizer"], items=items,
                    stats=StepStats(count=steps_measured, median_s=step_s, p10_s=step_s, p90_s=step_s, mean_s=step_s,
                                    basis="test")),
        flops=Flops(per_step=flops, bytes_per_step=1e8, mfu=mfu),
        memory=Memory(xla_peak_bytes=xla_peak, live_peak_bytes=live_peak),
        hot_ops=hot_ops or [],
        padding=padding,
    )
