"""Step statistics, the padding report, the roofline and the FLOP cross-check, on plain data."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tpu_agent.backend.core.generations import GENERATIONS
from tpu_agent.cli.profile_view import render_to_text
from tpu_agent.profilers import analysis, flopcheck, hlo
from tpu_agent.profilers.schema import Profile, Settings, Step, Steps


def steps(*walls, warmup=0, compiled=(), instrumented=()):
    return [Step(index=i, wall_s=w, warmup=i <= warmup, compiled=i in compiled, instrumented=i in instrumented)
            for i, w in enumerate(walls, 1)]


def test_percentiles_interpolate_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert analysis.percentile(values, 0.5) == 3.0
    assert analysis.percentile(values, 0.1) == pytest.approx(1.4)
    assert analysis.percentile(values, 0.9) == pytest.approx(4.6)


def test_step_stats_leave_out_warmup_compiles_and_the_instrumented_step():
    s = analysis.step_stats(steps(9.0, 8.0, 1.0, 7.0, 2.0, 3.0, warmup=2, compiled={4}, instrumented={1}))
    assert (s.count, s.median_s, s.mean_s) == (3, 2.0, 2.0)
    assert "excluding steps that compiled" in s.basis


def test_step_stats_fall_back_and_say_so():
    s = analysis.step_stats(steps(9.0, 5.0, 7.0, warmup=1, compiled={2, 3}))
    assert (s.count, s.median_s) == (2, 6.0)
    assert "including steps that compiled" in s.basis
    s = analysis.step_stats(steps(9.0, 5.0, warmup=2, instrumented={1}))
    assert (s.count, s.median_s) == (1, 5.0)
    assert "warm-up included" in s.basis
    assert analysis.step_stats([]) is None


def _dot(lhs, rhs, lc, rc, out):
    a, b, o = (hlo.Array("f32", d) for d in (lhs, rhs, out))
    k = 1
    for d in lc:
        k *= lhs[d]
    return hlo.Contraction("dot", a, b, o, 2.0 * o.elements * k,
                           {"lhs_contracting": lc, "rhs_contracting": rc, "lhs_batch": (), "rhs_batch": ()})


def _info(name, contractions, calls_per_step=1.0, flops=None, bytes_accessed=0.0, kind="fused",
          aten_op="aten.mm.default", source="train.py:9"):
    op = hlo.HotOp(name=f"{name}.dot", opcode="dot", fusion_kind=None, shape="f32[]",
                   flops=sum(c.flops for c in contractions), aten_op=aten_op, source=source,
                   contractions=contractions)
    return analysis.ExeInfo(name, kind, None, calls_per_step,
                            flops if flops is not None else op.flops, bytes_accessed, [op])


def test_padding_report_names_the_unaligned_sizes_and_their_waste():
    head = _dot((512, 128), (128, 50257), (1,), (0,), (512, 50257))  # vocab 50257 -> 50304 on v5e
    aligned = _dot((512, 128), (128, 256), (1,), (0,), (512, 256))
    report = analysis.padding_report([_info("g", [head, aligned], calls_per_step=2.0)], "v5e")
    assert (report.generation, report.mxu) == ("v5e", 128)
    (dim,) = report.dims
    assert (dim.size, dim.padded_to, dim.roles, dim.ops) == (50257, 50304, ["N"], ["aten.mm.default @ train.py:9"])
    wasted = 2 * 512 * 128 * (50304 - 50257) * 2.0  # FLOPs, twice per step
    assert dim.wasted_flops_per_step.value == pytest.approx(wasted)
    assert dim.wasted_flops_per_step.estimate is True
    padded_total = 2.0 * 512 * 128 * (50304 + 256)
    assert report.total_waste.value == pytest.approx(2 * 512 * 128 * 47 / (2 * 512 * 128 * (50304 + 256)))
    assert dim.share_of_padded_work == pytest.approx(wasted / 2 / padded_total)
    assert [o.unaligned for o in report.ops] == [["N=50257->50304"], []]


def test_eager_executables_give_their_own_aten_op_and_source():
    info = _info("aten.addmm.default", [_dot((127, 10), (10, 4), (1,), (0,), (127, 4))], kind="eager",
                 aten_op=None, source=None)
    info.source = "odd.py:3"
    rows = analysis.hot_ops([info], step_flops=info.flops)
    assert (rows[0].aten_op, rows[0].source, rows[0].share) == ("aten.addmm.default", "odd.py:3", 1.0)


def test_roofline_by_hand():
    gen = GENERATIONS["v5e"]
    # 1 GFLOP of aligned matmul, 1 MB accessed: compute-bound on v5e.
    big = _dot((1024, 1024), (1024, 512), (1,), (0,), (1024, 512))
    info = _info("g", [big], calls_per_step=3.0, bytes_accessed=1e6)
    t = analysis.roofline([info], "v5e", step_flops=3 * big.flops)
    compute = big.flops / gen.peak_bf16_flops
    assert t.compute_s.value == pytest.approx(3 * compute)
    assert t.memory_s.value == pytest.approx(3 * 1e6 / gen.hbm_bandwidth)
    assert t.step_s.value == pytest.approx(3 * max(compute, 1e6 / gen.hbm_bandwidth))
    assert t.bound == "compute"
    assert t.mfu.value == pytest.approx(1.0)
    assert all(e.estimate for e in (t.step_s, t.compute_s, t.memory_s, t.mfu))
    # profile.json's roofline says it is an estimate and what it assumes, as the console does
    dumped = t.model_dump()
    assert dumped["estimate"] is True and any("128-wide MXU" in a for a in dumped["assumptions"])
    # Padding costs MXU time: K = 1000 runs as 1024.
    odd = _dot((1024, 1000), (1000, 512), (1,), (0,), (1024, 512))
    t = analysis.roofline([_info("g", [odd])], "v5e", step_flops=odd.flops)
    assert t.compute_s.value == pytest.approx(odd.flops * 1024 / 1000 / gen.peak_bf16_flops)
    assert t.mfu.value == pytest.approx(1000 / 1024)


def test_flop_check_agreement_and_explanations():
    ok = flopcheck.compare("step 1", 105.0, 100.0, 100.0, {"aten.mm": 100.0})
    assert ok.agrees and ok.relative_difference == pytest.approx(0.05)
    assert "elementwise" in ok.explanation
    off = flopcheck.compare("step 1", 50.0, 50.0, 100.0, {"aten.mm": 100.0})
    assert not off.agrees and "dots alone" in off.explanation
    conv = flopcheck.compare("step 1", 80.0, 80.0, 100.0, {"aten.convolution_backward": 60.0})
    assert "convolution backward" in conv.explanation
    # XLA leaves out the multiply-adds against convolution padding: given back, the totals agree.
    padded = flopcheck.compare("step 1", 84.0, 100.0, 100.0, {"aten.convolution": 100.0}, conv_padding_flops=16.0)
    assert padded.relative_difference == pytest.approx(-0.16) and padded.adjusted_relative_difference == pytest.approx(0)
    assert padded.agrees and "zero padding" in padded.explanation and "elementwise" not in padded.explanation
    none = flopcheck.compare("step 1", 0.0, 0.0, 0.0, {})
    assert none.agrees


def test_summary_labels_every_estimate():
    head = _dot((512, 128), (128, 50257), (1,), (0,), (512, 50257))
    info = _info("g", [head], bytes_accessed=1e8)
    profile = Profile(
        status="stopped", exit_code=0, created_at=datetime.now(timezone.utc), script="/x/train.py", args=[],
        cwd="/x", run_dir="/x/.tpu-agent/runs/r", settings=Settings(target="v6e"), mode_used="fused",
        steps=Steps(markers=["optimizer"], items=steps(1.0, 0.5, 0.5, warmup=2),
                    stats=analysis.step_stats(steps(1.0, 0.5, 0.5, warmup=2))),
        hot_ops=analysis.hot_ops([info], head.flops), padding=analysis.padding_report([info], "v6e"),
        target=analysis.roofline([info], "v6e", head.flops),
    )
    text = render_to_text(Profile.model_validate_json(profile.model_dump_json()))
    padding_line = next(line for line in text.splitlines() if line.startswith("padding waste"))
    target_line = next(line for line in text.splitlines() if line.startswith("on TPU v6e"))
    assert "(estimate)" in padding_line and "estimate" in target_line
    assert "wasted FLOP/step (estimate)" in text
    assert "50257" in text and "50432" in text
    assert "median 500 ms" in text
