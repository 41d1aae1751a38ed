"""The numerics check on synthetic losses: exact plans match every step, others end within the tolerance."""

from __future__ import annotations

import math

import pytest

from tpu_agent.measure.numerics import check_exact, check_loss_tol, check_numerics


def test_exact_accepts_float32_noise_and_rejects_a_real_change() -> None:
    base = [2.31, 2.29, 2.25, 2.2, 2.1]
    noise = [x * (1 + 3e-7 * (-1) ** i) for i, x in enumerate(base)]
    ok = check_exact(base, noise)
    assert ok.passed and ok.max_rel_diff < 1e-6
    changed = base[:3] + [base[3] * (1 + 5e-5)] + base[4:]
    bad = check_exact(base, changed)
    assert not bad.passed
    assert bad.worst_step == 3
    assert "beyond" in bad.reason


def test_exact_rejects_different_step_counts_and_nan() -> None:
    assert not check_exact([1.0, 2.0], [1.0]).passed
    nan = check_exact([1.0, 2.0], [1.0, math.nan])
    assert not nan.passed and nan.worst_step == 1


def test_loss_tol() -> None:
    base = [2.3, 2.0, 1.8, 1.6, 1.5, 1.4]
    slightly_worse = [x * 1.01 for x in base]
    assert check_loss_tol(base, slightly_worse).passed
    better = [x * 0.8 for x in base]
    assert check_loss_tol(base, better).passed
    worse = [x * 1.05 for x in base]
    r = check_loss_tol(base, worse)
    assert not r.passed and "worse than" in r.reason
    assert r.tail == 3 and r.baseline_final == pytest.approx(1.5)
    assert check_loss_tol(base, worse, loss_tol=0.06).passed
    assert not check_loss_tol(base, base[:-1] + [math.inf]).passed


def test_check_numerics_picks_the_check_from_the_plan() -> None:
    base = [2.0, 1.9, 1.8]
    cand = [2.0, 1.9, 1.81]
    assert check_numerics(base, cand, preserves_numerics=True).kind == "exact"
    assert not check_numerics(base, cand, preserves_numerics=True).passed
    r = check_numerics(base, cand, preserves_numerics=False)
    assert r.kind == "loss_tol" and r.passed
