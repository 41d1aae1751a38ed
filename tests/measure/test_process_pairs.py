"""The verification's interval counts the spread between process pairs (synthetic timings, no processes).

Each process has its own speed offset (memory layout, thread placement, the machine's minute), drawn within
+-5 %, and each step its own noise. Step pairs inside one process pair share both processes' offsets: an interval
over those steps alone is an interval on that pair's luck.
"""

from __future__ import annotations

import numpy as np
import pytest

from tpu_agent.measure.stats import speedup, two_level_median_ci

OFFSET = 0.05  # each process's own speed offset: uniform in +-5 %
TRIALS = 200


def processes(seed: int, count: int, steps: int, true_speedup: float, jitter: float = 0.03):
    """`count` process pairs of `steps` interleaved steps: (baseline times, candidate times, process pair labels)."""
    rng = np.random.default_rng(seed)
    a, b, groups = [], [], []
    for g in range(count):
        own_a, own_b = 1 + rng.uniform(-OFFSET, OFFSET, size=2)
        machine = 0.050 * np.exp(np.cumsum(rng.normal(0.0, 0.02, size=steps)))  # shared drift within the pair
        a += (machine * own_a * rng.lognormal(0.0, jitter, size=steps)).tolist()
        b += (machine * own_b / true_speedup * rng.lognormal(0.0, jitter, size=steps)).tolist()
        groups += [g] * steps
    return a, b, groups


def passes(count: int, steps: int, true_speedup: float, replicated: bool) -> float:
    hits = 0
    for seed in range(TRIALS):
        a, b, groups = processes(seed, count, steps, true_speedup)
        hits += speedup(a, b, seed=seed, resamples=1000, groups=groups if replicated else None).accepted
    return hits / TRIALS


def test_one_process_pair_passes_aa_three_do_not() -> None:
    """Today's interval (20 pairs of one process pair) passes A/A whenever that pair's luck favours the candidate
    by more than --min-gain; three process pairs of 7 steps, the two-level interval, about never."""
    one_pair = passes(1, 20, 1.0, replicated=False)
    assert one_pair >= 0.08, one_pair  # measured 0.145 (29 of 200): pseudo-replication
    three_pairs = passes(3, 7, 1.0, replicated=True)
    assert three_pairs <= 1 / 60, three_pairs  # measured 0.01 (2 of 200)


def test_three_process_pairs_pass_a_real_15_percent_gain() -> None:
    assert passes(3, 7, 1.15, replicated=True) >= 0.95  # measured 0.99


def test_estimate_says_its_process_pairs() -> None:
    a, b, groups = processes(0, 3, 7, 1.15)
    est = speedup(a, b, groups=groups)
    assert est.processes == 3 and est.pairs == 21
    assert "21 pairs in 3 process pairs" in est.text() and "in 3 process pairs" in est.reason
    assert speedup(a, b).processes == 1 and "21 pairs)" in speedup(a, b).text()


def test_two_level_interval_spans_the_process_pairs() -> None:
    """Three pairs whose steps are tight but whose levels differ: the interval reaches about from the lowest
    pair's level to the highest's, where the one-level bootstrap of the pooled steps stays inside."""
    rng = np.random.default_rng(0)
    levels = [0.96, 1.00, 1.05]
    values = np.concatenate([lv * np.exp(rng.normal(0, 0.002, 7)) for lv in levels])
    groups = [np.arange(7 * i, 7 * i + 7) for i in range(3)]
    low, high = two_level_median_ci(values, groups, resamples=2000)
    assert low < 0.975 and high > 1.04
    # seeded: the same data gives the same interval
    assert (low, high) == two_level_median_ci(values, groups, resamples=2000)


def test_groups_of_different_sizes_and_bad_labels() -> None:
    a, b, groups = processes(1, 3, 7, 1.0)
    est = speedup(a[:-2], b[:-2], groups=groups[:-2])  # the last pair ended early
    assert est.processes == 3 and est.pairs == 19
    with pytest.raises(ValueError, match="one label per pair"):
        speedup(a, b, groups=groups[:-1])
