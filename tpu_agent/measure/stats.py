"""Paired statistics: is a candidate really faster (or smaller) than its baseline?

Noise on a shared machine is large and drifts, so a candidate (B) is timed
interleaved with the baseline (A): A B A B ... Each pair shares the machine's
state at that moment, so the pairwise ratio A/B cancels slow drift and shared
outliers; the median of the ratios ignores the outliers that hit one side
only. A seeded bootstrap over the pairs gives a 95 % interval (widened to the
distribution-free order-statistic interval where that is wider), and a change
is accepted only when the interval's lower end clears 1 + min_gain: an
identical candidate (A/A) must essentially never pass.

Step pairs inside one process pair share that pair's luck (memory layout,
thread placement, what the machine did that minute): a verification measures
several fresh process pairs, and its interval comes from a two-level
bootstrap (the process pairs resampled, then the steps within each), so the
spread between process pairs widens it. An interval over the steps of one
process pair alone passes an A/A comparison whenever that pair's luck favoured
the candidate by more than --min-gain.

Everything here is pure arithmetic on numbers the runner measured: no
processes, no clocks, so it is tested on synthetic data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, Field

from tpu_agent.config import MIN_PAIRS, TuneOptions

MIN_GAIN: float = TuneOptions.model_fields["min_gain"].default  # --min-gain's default, declared in config
CONFIDENCE = 0.95
RESAMPLES = 4000


class _Interval(BaseModel):
    """What a bootstrap verdict on paired measurements carries, whatever was measured."""

    pairs: int
    processes: int = Field(1, description="fresh process pairs the pairs came from (the interval's replication unit)")
    ci_low: float
    ci_high: float
    confidence: float = CONFIDENCE
    min_gain: float
    reason: str
    resamples: int
    seed: int


class SpeedupEstimate(_Interval):
    """Speedup of B over A from interleaved pairs: median of A/B with a bootstrap interval."""

    per_sample: bool = Field(description="times were divided by the batch size before comparing")
    baseline_median_s: float = Field(description="median baseline time (per sample when per_sample)")
    candidate_median_s: float
    speedup: float = Field(description="median of the pairwise ratios baseline / candidate; > 1 is faster")
    accepted: bool = Field(description="ci_low > 1 + min_gain")
    ratios: list[float] = Field(default_factory=list, description="the pairwise ratios, in pair order")

    @property
    def gain(self) -> float:
        """The median relative gain, e.g. 0.15 for 15 % faster."""
        return self.speedup - 1.0

    def text(self) -> str:
        """One line for people: `1.457x (95% CI 1.405-1.568, 18 pairs)`."""
        unit = " per sample" if self.per_sample else ""
        n = counted(self.pairs, self.processes)
        return f"{self.speedup:.3f}x{unit} (95% CI {self.ci_low:.3f}-{self.ci_high:.3f}, {n})"


class MemoryEstimate(_Interval):
    """Relative saving of B's measured peak bytes over A's: median of 1 - B/A with a bootstrap interval."""

    baseline_median_bytes: float
    candidate_median_bytes: float
    saving: float = Field(description="median of the pairwise 1 - candidate / baseline; > 0 is smaller")
    accepted: bool = Field(description="ci_low > min_gain")



def counted(pairs: int, processes: int) -> str:
    """`20 pairs`, or `21 pairs in 3 process pairs`."""
    return f"{pairs} pairs" if processes <= 1 else f"{pairs} pairs in {processes} process pairs"


def group_index(groups: Sequence[int] | None, n: int) -> list[np.ndarray]:
    """The positions of each process pair's values (`groups[i]`: the process pair of value i); one group when
    None."""
    if groups is None:
        return [np.arange(n)]
    labels = np.asarray(list(groups))
    if labels.shape != (n,):
        raise ValueError(f"groups needs one label per pair: {len(labels)} labels for {n} pairs")
    return [np.flatnonzero(labels == g) for g in dict.fromkeys(labels.tolist())]


def two_level_median_ci(values: np.ndarray, groups: list[np.ndarray], *, confidence: float = CONFIDENCE,
                        resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the pooled median from a two-level bootstrap: each resample draws the process pairs
    with replacement, then, within each drawn pair, its steps with replacement (seeded).

    The spread between process pairs enters through the first level: three process pairs whose ratios sit at
    0.96, 1.00 and 1.05 give an interval about that wide, however tight each pair's own steps are.
    """
    if not 0 < confidence < 1:
        raise ValueError("confidence must be between 0 and 1")
    rng = np.random.default_rng(seed)
    k = len(groups)
    longest = max(len(g) for g in groups)
    table = np.full((k, longest), np.nan)  # row g: group g's values, NaN-padded
    for row, idx in enumerate(groups):
        table[row, :len(idx)] = values[idx]
    sizes = np.array([len(g) for g in groups])
    drawn = rng.integers(0, k, size=(resamples, k))  # level 1: process pairs
    within = (rng.random((resamples, k, longest)) * sizes[drawn][:, :, None]).astype(int)  # level 2: steps
    picked = table[drawn[:, :, None], within]
    picked[np.arange(longest)[None, None, :] >= sizes[drawn][:, :, None]] = np.nan  # a shorter pair's padding
    medians = np.nanmedian(picked.reshape(resamples, -1), axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians, [alpha, 1.0 - alpha])
    return float(low), float(high)


def interval(values: np.ndarray, groups: Sequence[int] | None, *, confidence: float = CONFIDENCE,
             resamples: int = RESAMPLES, seed: int = 0) -> tuple[tuple[float, float], int]:
    """(the interval of the median, the process pairs it counted): two-level over several process pairs, else the
    one-pair interval (median_ci)."""
    parts = group_index(groups, len(values))
    if len(parts) > 1:
        return two_level_median_ci(values, parts, confidence=confidence, resamples=resamples, seed=seed), len(parts)
    return median_ci(values, confidence=confidence, resamples=resamples, seed=seed), 1


def _times(values: Sequence[float], what: str) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a flat list of numbers")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{what}: every value must be a finite number > 0")
    return arr


def _paired(baseline: Sequence[float], candidate: Sequence[float], min_pairs: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    a = _times(baseline, f"baseline {what}")
    b = _times(candidate, f"candidate {what}")
    if len(a) != len(b):
        raise ValueError(f"paired {what} need the same count: {len(a)} baseline vs {len(b)} candidate")
    if len(a) < min_pairs:
        raise ValueError(f"at least {min_pairs} interleaved pairs are needed, got {len(a)}")
    return a, b


def bootstrap_median_ci(values: np.ndarray, *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median, resampling whole pairs (seeded: same data, same answer)."""
    if not 0 < confidence < 1:
        raise ValueError("confidence must be between 0 and 1")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    medians = np.median(values[idx], axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians, [alpha, 1.0 - alpha])
    return float(low), float(high)


def order_statistic_median_ci(values: np.ndarray, *, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Distribution-free interval of the median from order statistics (Hettmansperger-Sheather interpolation).

    [x_(k), x_(n-k+1)] covers the median with probability 1 - 2 P(B < k),
    B ~ Binomial(n, 1/2): too much or too little for a given level, so the
    bounds are interpolated between neighbouring order statistics to reach it.
    With n < 6 even the full range is short of 95 %: it is returned as is.
    """
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)

    def cover(k: int) -> float:  # coverage of [x_(k), x_(n-k+1)], 1-based k
        return 1.0 - 2.0 * sum(math.comb(n, j) for j in range(k)) / 2.0**n

    k = 1
    while k + 1 <= n // 2 and cover(k + 1) >= confidence:
        k += 1
    if cover(k) <= confidence or k + 1 > (n + 1) // 2:
        return float(x[k - 1]), float(x[n - k])
    g_k, g_next = cover(k), cover(k + 1)
    i = (g_k - confidence) / (g_k - g_next)
    lam = (n - k) * i / (k + (n - 2 * k) * i)
    low = (1 - lam) * x[k - 1] + lam * x[k]
    high = (1 - lam) * x[n - k] + lam * x[n - k - 1]
    return float(low), float(high)


def median_ci(values: np.ndarray, *, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
              seed: int = 0) -> tuple[float, float]:
    """The seeded bootstrap interval, widened to the distribution-free one where that is wider.

    Why both: the percentile bootstrap of a median is too narrow with a few
    pairs (measured on lognormal ratios: the true median fell below its 95 %
    lower bound 3.3-3.9 % of the time with 5-30 pairs, not 2.5 %); the
    order-statistic interval holds its level, so acceptance stays honest.
    """
    b_low, b_high = bootstrap_median_ci(values, confidence=confidence, resamples=resamples, seed=seed)
    o_low, o_high = order_statistic_median_ci(values, confidence=confidence)
    return min(b_low, o_low), max(b_high, o_high)


def speedup(
    baseline_s: Sequence[float],
    candidate_s: Sequence[float],
    *,
    baseline_batch: int | None = None,
    candidate_batch: int | None = None,
    min_gain: float = MIN_GAIN,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
    min_pairs: int = MIN_PAIRS,
    groups: Sequence[int] | None = None,
) -> SpeedupEstimate:
    """Compare interleaved step times (pair i = baseline_s[i], candidate_s[i], measured back to back after warm-up).

    Give both batch sizes when the candidate changes the batch: the times are
    then compared per sample, since a bigger step that carries more samples is
    not slower per sample. `groups` labels each pair with its process pair: with two or more, the interval is
    the two-level bootstrap's (the spread between process pairs counted).
    """
    a, b = _paired(baseline_s, candidate_s, min_pairs, "step times")
    per_sample = baseline_batch is not None or candidate_batch is not None
    if per_sample:
        if not baseline_batch or not candidate_batch or baseline_batch < 1 or candidate_batch < 1:
            raise ValueError("per-sample comparison needs both batch sizes, each >= 1")
        a = a / baseline_batch
        b = b / candidate_batch
    if min_gain < 0:
        raise ValueError("min_gain must be >= 0")
    ratios = a / b
    median = float(np.median(ratios))
    (low, high), processes = interval(ratios, groups, confidence=confidence, resamples=resamples, seed=seed)
    threshold = 1.0 + min_gain
    accepted = low > threshold
    unit = "per sample" if per_sample else "per step"
    ci = f"{confidence:.0%} CI {low:.3f}-{high:.3f}"
    n = counted(len(a), processes)
    if accepted:
        reason = f"{median:.3f}x faster {unit} ({ci}, {n}): the lower bound clears {threshold:.3f}"
    elif median <= 1.0:
        reason = f"not faster {unit}: {median:.3f}x ({ci}, {n})"
    else:
        reason = (f"gain not shown {unit}: {median:.3f}x, but the {ci} reaches below {threshold:.3f} "
                  f"({n}; noise or a gain under {min_gain:.0%})")
    return SpeedupEstimate(
        pairs=len(a), processes=processes, per_sample=per_sample, baseline_median_s=float(np.median(a)),
        candidate_median_s=float(np.median(b)),
        speedup=median, ci_low=low, ci_high=high, confidence=confidence, min_gain=min_gain, accepted=accepted,
        reason=reason, resamples=resamples, seed=seed, ratios=[float(r) for r in ratios],
    )


def memory_saving(
    baseline_bytes: Sequence[float],
    candidate_bytes: Sequence[float],
    *,
    min_gain: float = MIN_GAIN,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
    min_pairs: int = MIN_PAIRS,
    groups: Sequence[int] | None = None,
) -> MemoryEstimate:
    """Compare measured peak bytes (per device) of paired runs; accepted when the saving's lower bound > min_gain."""
    a, b = _paired(baseline_bytes, candidate_bytes, min_pairs, "peak bytes")
    if min_gain < 0:
        raise ValueError("min_gain must be >= 0")
    savings = 1.0 - b / a
    median = float(np.median(savings))
    (low, high), processes = interval(savings, groups, confidence=confidence, resamples=resamples, seed=seed)
    accepted = low > min_gain
    ci = f"{confidence:.0%} CI {low:.1%} to {high:.1%}"
    n = counted(len(a), processes)
    if accepted:
        reason = f"peak memory {median:.1%} smaller ({ci}, {n}): the lower bound clears {min_gain:.0%}"
    elif median <= 0:
        reason = f"peak memory not smaller: {median:+.1%} saving ({ci}, {n})"
    else:
        reason = f"saving not shown: {median:.1%}, but the {ci} reaches below {min_gain:.0%} ({n})"
    return MemoryEstimate(
        pairs=len(a), processes=processes, baseline_median_bytes=float(np.median(a)),
        candidate_median_bytes=float(np.median(b)),
        saving=median, ci_low=low, ci_high=high, confidence=confidence, min_gain=min_gain, accepted=accepted,
        reason=reason, resamples=resamples, seed=seed,
    )
