"""One comparison of two plans' interleaved pairs, read the same way by the search's trials and by the
verification: the speed ratio and its interval, the memory ratio, the numerics check.

A is the baseline (or, in an ablation, the plan without one unit) and B the plan measured against it. When B
changes the batch, times are compared per sample. Pairs in which a process compiled say nothing of the steady
state and are left out, unless too few are left or a process keeps compiling (then its compiles are its cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from tpu_agent.config import TuneOptions
from tpu_agent.measure.numerics import NumericsCheck, check_plan_numerics
from tpu_agent.measure.stats import MIN_PAIRS, MemoryEstimate, SpeedupEstimate, median_ci, memory_saving, speedup
from tpu_agent.measure.trials import StepRecord, rank_records
from tpu_agent.plan.actions import PadDim, Plan

MIN_STEADY = 3  # pairs without compilation a trial's ratio needs; with fewer, every pair counts


def batch_size(plan: Plan, baseline_batch: int | None) -> int | None:
    """The candidate's batch when a PadDim changes the batch literal (time is then per sample)."""
    if baseline_batch is None:
        return None
    for action in plan.of(PadDim):
        if action.batch or (action.name and "batch" in action.name.lower()):  # the name: plans before `batch`
            return action.new
    return baseline_batch


def keeps_compiling(steps: list[StepRecord]) -> bool:
    """A process still compiling in more than a third of its later steps (shapes that change every batch), not
    one whose first timed steps finished compiling: its compiles are its steady state, and leaving them out
    would time it without its main cost."""
    if not steps:
        return False
    middle = sorted(s.step for s in steps)[len(steps) // 2]
    late = [s for s in steps if s.step >= middle]
    return 3 * sum(s.compiled for s in late) > len(late)


def steady(a: list[StepRecord], b: list[StepRecord], least: int = MIN_STEADY) -> tuple[list[StepRecord],
                                                                                     list[StepRecord]]:
    """The pairs in which neither process compiled (warm-up can end before XLA's last compile), or all of them
    when fewer than `least` are left (an interval needs its minimum of pairs) or a side keeps compiling."""
    kept = [(x, y) for x, y in zip(a, b) if not (x.compiled or y.compiled)]
    if len(kept) < least or keeps_compiling(a) or keeps_compiling(b):
        return a, b
    return [x for x, _ in kept], [y for _, y in kept]


def process_pairs(a: list[StepRecord], b: list[StepRecord]) -> list[int]:
    """Which process pair each pair came from: a fresh process counts its steps from 1 again, so a step number
    that does not follow its predecessor's on either side starts another process pair (a verification's rounds)."""
    labels, group = [], 0
    for i, (x, y) in enumerate(zip(a, b)):
        if i and (x.step <= a[i - 1].step or y.step <= b[i - 1].step):
            group += 1
        labels.append(group)
    return labels


def steady_groups(a: list[StepRecord], b: list[StepRecord], least: int) -> tuple[list[StepRecord],
                                                                                 list[StepRecord], list[int]]:
    """steady(), with the process pair of each pair kept."""
    labels = process_pairs(a, b)
    kept_a, kept_b = steady(a, b, least)
    if len(kept_a) == len(a):
        return a, b, labels
    keep = [i for i, (x, y) in enumerate(zip(a, b)) if not (x.compiled or y.compiled)]
    return kept_a, kept_b, [labels[i] for i in keep]


def steady_ratios(a: list[StepRecord], b: list[StepRecord], scale: float) -> list[float]:
    """A / B time of each pair in which neither process compiled (examples/mlp.py compiled in each of its first 8
    steps, at 4x the steady step time), times `scale` (B's batch over A's when the batch changes)."""
    return [scale * x.wall_s / y.wall_s for x, y in zip(a, b) if not (x.compiled or y.compiled)]


def median(values: list[float]) -> float:
    """The upper median, as the search has always taken it (no interpolation)."""
    return sorted(values)[len(values) // 2]


def losses_of(steps: list[StepRecord]) -> list[float]:
    return [s.loss for s in steps if s.loss is not None]


def losses_by_step(steps: list[StepRecord], into: dict[tuple[int, int], float] | None = None
                   ) -> dict[tuple[int, int], float]:
    """Each (step, rank)'s loss, the first one measured kept (`into`: added to those known already); one process
    is rank 0, an N-rank job's step gives every rank's own loss."""
    out = {} if into is None else into
    for s in steps:
        for rank, own in enumerate(rank_records(s)):
            if own.loss is not None:
                out.setdefault((s.step, rank), own.loss)
    return out


def aligned_losses(baseline: dict[tuple[int, int], float], steps: list[StepRecord]) -> list[tuple[float, float, int]]:
    """(A's loss, B's loss, rank) at each of B's steps, for each rank, that A has a loss for: every rank against
    the same rank of A."""
    return [(baseline[(s.step, rank)], own.loss, rank) for s in steps for rank, own in enumerate(rank_records(s))
            if own.loss is not None and (s.step, rank) in baseline]


def rank_memory(steps: list[StepRecord]) -> list[int]:
    """Each rank's median peak device bytes over `steps` (one process: one figure)."""
    per_rank = [rank_records(s) for s in steps]
    if not per_rank:
        return []
    return [median([ranks[r].device_bytes for ranks in per_rank]) for r in range(min(len(x) for x in per_rank))]


def shown_bytes(count: float) -> str:
    """Device bytes as a line says them: MiB, or KiB under one MiB (a small model's ranks would read 0.00 MiB)."""
    return f"{count / 2**20:.2f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def rank_memory_line(a: list[StepRecord], b: list[StepRecord]) -> str | None:
    """Each rank's peak device bytes, B against A (medians over the pairs, measured at every step boundary);
    None for one process."""
    before, after = rank_memory(a), rank_memory(b)
    if len(after) < 2:
        return None
    ranks = ", ".join(f"rank {r} {shown_bytes(y)} (baseline {shown_bytes(x)})"
                      for r, (x, y) in enumerate(zip(before, after)))
    return f"peak device memory per rank, measured: {ranks}"


@dataclass
class Comparison:
    """`plan` (B) against `without` (A) from interleaved pairs `a` and `b`, with the losses of both at the same
    steps. The search reads a trial's figures (`ratio`, `interval`, `memory_ratio`, `numerics`); the
    verification the estimates it accepts on (`speedup`, `memory`, with `compiling_notes`)."""

    a: list[StepRecord]
    b: list[StepRecord]
    plan: Plan
    options: TuneOptions
    baseline_batch: int | None = None
    without: Plan = field(default_factory=Plan)
    losses: list[tuple] = field(default_factory=list)  # (A's loss, B's loss[, rank]): aligned_losses

    @cached_property
    def batches(self) -> tuple[int | None, int | None]:
        """A's and B's batch when B changes it (times are then compared per sample); else (None, None)."""
        before, after = batch_size(self.without, self.baseline_batch), batch_size(self.plan, self.baseline_batch)
        return (before, after) if self.baseline_batch is not None and before != after else (None, None)

    @property
    def per_sample(self) -> bool:
        return self.batches[0] is not None

    @property
    def scale(self) -> float:
        before, after = self.batches
        return after / before if before else 1.0

    # --- a trial's figures ------------------------------------------------------------------------------------
    def running(self) -> list[float]:
        """The ratio of each pair so far in which neither process compiled: what a pruner reads mid-trial."""
        return steady_ratios(self.a, self.b, self.scale)

    @cached_property
    def ratios(self) -> list[float]:
        """The trial's pair ratios: its steady pairs (every pair while fewer than MIN_STEADY are steady)."""
        a, b = steady(self.a, self.b)
        return [self.scale * x.wall_s / y.wall_s for x, y in zip(a, b)]

    @property
    def ratio(self) -> float:
        """A / B, the upper median of the ratios: > 1 is faster."""
        return median(self.ratios)

    def interval(self) -> tuple[float, float]:
        """The ratios' 95 % interval (seeded): a search's figure; the verification's is stricter."""
        return median_ci(np.asarray(self.ratios), seed=self.options.seed)

    @property
    def memory_ratio(self) -> float | None:
        """B's peak device bytes over A's (medians); None without A's figures."""
        base = median([s.device_bytes for s in self.a])
        return median([s.device_bytes for s in self.b]) / base if base else None

    def numerics(self) -> tuple[NumericsCheck | None, Plan]:
        """The check B's losses call for (None: no step has both losses), and B as its losses class it; with
        several ranks, each rank's losses against the same rank's of A, the worst rank's check (a failed one
        first) standing for all."""
        if not self.losses:
            return None, self.plan
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for x, y, *rank in self.losses:
            by_rank.setdefault(rank[0] if rank else 0, []).append((x, y))
        checks = {r: check_plan_numerics(self.plan, [x for x, _ in pairs], [y for _, y in pairs], self.options)
                  for r, pairs in sorted(by_rank.items())}
        if len(checks) == 1:
            return next(iter(checks.values()))
        rank = max(checks, key=lambda r: (not checks[r][0].passed, checks[r][0].max_rel_diff or 0.0))
        check, plan = checks[rank]
        said = (f"each of the {len(checks)} ranks against the baseline's same rank; the worst, rank {rank}"
                if check.passed else f"rank {rank} (of {len(checks)}, each against the baseline's same rank)")
        return check.model_copy(update={"reason": f"{said}: {check.reason}"}), plan

    # --- the estimates a verification accepts on --------------------------------------------------------------
    def speedup(self) -> SpeedupEstimate:
        """The speedup with its interval, on steady pairs (at least MIN_PAIRS of them), accepted on --min-gain;
        pairs from several process pairs (a verification's rounds) get the two-level interval."""
        a, b, groups = steady_groups(self.a, self.b, MIN_PAIRS)
        before, after = self.batches
        return speedup([s.wall_s for s in a], [s.wall_s for s in b], min_gain=self.options.min_gain,
                       seed=self.options.seed, baseline_batch=before, candidate_batch=after, groups=groups)

    def memory(self) -> MemoryEstimate | None:
        """The peak-memory saving with its interval; None when a step has no device figure."""
        if not all(s.device_bytes for s in self.a + self.b):
            return None
        return memory_saving([s.device_bytes for s in self.a], [s.device_bytes for s in self.b],
                             min_gain=self.options.min_gain, seed=self.options.seed,
                             groups=process_pairs(self.a, self.b))

    def compiling_notes(self) -> list[str]:
        """What a speedup leaves out or keeps in of compiles, said so that it is read as such."""
        notes = []
        steady_a, _ = steady(self.a, self.b, least=MIN_PAIRS)
        if len(steady_a) < len(self.a):
            notes.append(f"{len(self.a) - len(steady_a)} of {len(self.a)} pairs left out: a process compiled in them")
        if keeps_compiling(self.a):
            compiled = sum(s.compiled for s in self.a)
            notes.append(f"compiles included: the baseline compiled new shapes in {compiled} of its {len(self.a)} "
                         "measured steps, a cost that lasts while new lengths keep arriving (a long run that has "
                         "seen every length stops paying it)")
        return notes
