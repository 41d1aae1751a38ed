"""One comparison of interleaved pairs, as the search's trials and the verification read it (no processes)."""

from __future__ import annotations

import pytest

from tpu_agent.config import TuneOptions
from tpu_agent.measure.compare import Comparison, aligned_losses, losses_by_step
from tpu_agent.measure.trials import StepRecord
from tpu_agent.plan.actions import Compile, PadDim, PadOps, Plan

FUSED = Plan(actions=[Compile(mode="fused")])


def steps(times: list[float], compiled: int = 0, loss: float | None = 2.0, device_bytes: int = 1000) -> list[StepRecord]:
    return [StepRecord(step=i + 1, wall_s=t, compiled=i < compiled, loss=loss, device_bytes=device_bytes)
            for i, t in enumerate(times)]


def test_a_trial_and_a_verification_read_the_same_steady_pairs():
    # the candidate compiles in its first 2 pairs (5x its steady time), then runs 1.25x faster
    a = steps([0.010] * 10)
    b = steps([0.040] * 2 + [0.008] * 8, compiled=2)
    compared = Comparison(a, b, FUSED, TuneOptions(seed=0))
    assert compared.ratios == pytest.approx([1.25] * 8) and compared.ratio == pytest.approx(1.25)
    low, high = compared.interval()
    assert low == pytest.approx(1.25) and high == pytest.approx(1.25)
    speed = compared.speedup()
    assert speed.pairs == 8 and speed.speedup == pytest.approx(1.25) and speed.accepted
    assert compared.compiling_notes() == ["2 of 10 pairs left out: a process compiled in them"]
    # mid-trial, a pruner reads only the steady pairs so far
    assert Comparison(a[:3], b[:3], FUSED, TuneOptions()).running() == pytest.approx([1.25])


def test_a_verification_keeps_its_minimum_of_pairs_where_a_trial_would_not():
    a, b = steps([0.010] * 6), steps([0.040] * 3 + [0.008] * 3, compiled=3)
    compared = Comparison(a, b, FUSED, TuneOptions())
    assert len(compared.ratios) == 3  # a trial judges on 3 steady pairs
    assert compared.speedup().pairs == 6 and compared.compiling_notes() == []  # an interval keeps its 5: all 6


def test_a_baseline_that_keeps_compiling_is_timed_with_its_compiles_and_says_so():
    a = steps([0.050, 0.010] * 5)
    a = [s.model_copy(update={"compiled": s.step % 2 == 1}) for s in a]
    compared = Comparison(a, steps([0.010] * 10), FUSED, TuneOptions())
    assert len(compared.ratios) == 10
    (note,) = compared.compiling_notes()
    assert note.startswith("compiles included: the baseline compiled new shapes in 5 of its 10 measured steps")


def test_a_plan_that_changes_the_batch_is_compared_per_sample():
    batch = PadDim(file="t.py", line=1, column=0, old=32, new=64, name="BATCH", batch=True)
    plan = Plan(actions=[batch])
    compared = Comparison(steps([0.010] * 6), steps([0.016] * 6), plan, TuneOptions(), baseline_batch=32)
    assert compared.per_sample and compared.batches == (32, 64)
    assert compared.ratio == pytest.approx(1.25) and compared.speedup().speedup == pytest.approx(1.25)
    # an ablation of the same plan against itself without the batch change: per sample too
    without = Comparison(steps([0.010] * 6), steps([0.016] * 6), plan, TuneOptions(), baseline_batch=32,
                         without=Plan())
    assert without.batches == (32, 64)
    same = Comparison(steps([0.010] * 6), steps([0.010] * 6), plan, TuneOptions(), baseline_batch=32, without=plan)
    assert not same.per_sample and same.scale == 1.0


def test_memory_and_numerics_from_the_same_pairs():
    a, b = steps([0.010] * 6, device_bytes=2000), steps([0.010] * 6, device_bytes=1000)
    compared = Comparison(a, b, FUSED, TuneOptions())
    assert compared.memory_ratio == 0.5 and compared.memory().saving == pytest.approx(0.5)
    assert compared.numerics() == (None, FUSED)  # no losses at the same steps: nothing to check
    assert Comparison(a, steps([0.010] * 6, device_bytes=0), FUSED, TuneOptions()).memory() is None

    baseline = losses_by_step(steps([0.010] * 6, loss=2.0))
    assert losses_by_step(steps([0.010] * 2, loss=3.0), into=baseline)[(1, 0)] == 2.0  # the first loss of a step stays
    losses = aligned_losses(baseline, steps([0.010] * 8, loss=2.0))
    assert len(losses) == 6  # the candidate's steps 7 and 8 have no baseline loss
    check, plan = Comparison(a, b, FUSED, TuneOptions(), losses=losses).numerics()
    assert check.kind == "loss_tol" and check.passed and plan == FUSED  # fused execution rounds otherwise
    padded = Plan(actions=[PadOps(multiple=8)])
    check, plan = Comparison(a, b, padded, TuneOptions(), losses=losses).numerics()
    assert check.kind == "exact" and check.passed and plan == padded
