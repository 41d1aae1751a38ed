"""What Optuna calls for each trial: the plan the trial's picks make, measured in turns with the warm baseline
and compared with it (measure.compare). The trial's value, constraints and attributes go to the study, its
record to the search's list; invalid and repeated plans are recorded without running, failures without
stopping the study."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.measure.compare import aligned_losses, losses_by_step, losses_of, median, rank_memory, rank_memory_line
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.numerics import NumericsCheck
from tpu_agent.measure.trials import StepRecord, TrialFailed
from tpu_agent.plan.actions import Plan
from tpu_agent.search import storage
from tpu_agent.search.records import MEASURED, TrialRecord, TrialState
from tpu_agent.search.sampling import invalid_for_devices, plan_for
from tpu_agent.search.space import OFF, Space
from tpu_agent.search.storage import orphan

# Core constraints (Trial.set_constraint): a trial is feasible when every value is <= 0. TPE then ranks an
# infeasible trial below every feasible one, best_trial skips it, and the dashboard shows it as infeasible.
NUMERICS = "numerics"  # how far the losses are beyond the check's tolerance (relative loss difference - tolerance)
OUT_OF_MEMORY = "out_of_memory"  # 1: the plan ran out of device memory (nothing else measured)
DECIDE_WAIT_S = 10.0  # how long a trial waits for another's claim of its plan to decide (it takes two storage reads)
_RUNNING = optuna.trial.TrialState.RUNNING
_NO_FINITE = 1e9  # a non-finite loss: JSON (the storage, the dashboard) cannot carry infinity


def numerics_margin(check: NumericsCheck) -> float:
    """The numerics check as a constraint value: > 0 exactly when the check failed."""
    if check.kind == "exact":
        margin = (check.max_rel_diff if check.max_rel_diff is not None else math.inf) - check.tolerance
    elif check.baseline_final is None or check.candidate_final is None:
        margin = math.inf
    else:
        base = check.baseline_final
        margin = (check.candidate_final - base) / max(abs(base), 1e-8) - check.tolerance
    if not math.isfinite(margin):
        margin = _NO_FINITE
    if check.passed:
        return min(margin, 0.0)
    return margin if margin > 0 else 1e-12  # a failed check is never feasible, whatever the rounding


def objective_value(options: TuneOptions, speed: float | None, memory_ratio: float | None) -> float:
    if options.objective == "time":
        return speed or 0.0
    if options.objective == "memory":
        return (1.0 / memory_ratio) if memory_ratio else 0.0
    return (speed or 0.0) * ((1.0 / memory_ratio) if memory_ratio else 1.0)


class Failed(Exception):
    """A trial that could not produce a value: Optuna records it as FAIL and goes on."""


@dataclass
class Measured:
    """A plan measured before (this run or an earlier one): what a repeat of it records without running."""

    number: int
    value: float | None  # None: it failed or was pruned
    constraints: dict[str, float] = field(default_factory=dict)
    reported: dict[int, float] = field(default_factory=dict)  # its intermediate values, step -> value
    pruned: bool = False


class PairReport:
    """A trial's pairs as they come in, told to the pruner: the running median of the steady ratios, or each
    pair's own ratio for a pruner that compares pairs (`per_pair`); kept in `reported` by pair index."""

    def __init__(self, trial: optuna.Trial, plan: Plan, measuring: Measuring, per_pair: bool) -> None:
        self.trial, self.plan, self.measuring, self.per_pair = trial, plan, measuring, per_pair
        self.reported: dict[int, float] = {}

    def __call__(self, i: int, a: list[StepRecord], b: list[StepRecord]) -> None:
        if a[-1].compiled or b[-1].compiled:  # a compiling step says nothing of the steady state: not judged
            return
        kept = self.measuring.compare(a, b, self.plan).running()
        k, running = len(kept) - 1, median(kept)
        self.reported[k] = kept[-1] if self.per_pair else running
        self.trial.report(self.reported[k], k)
        # Clearly slow: slower than the baseline, and the pruner says so (under the median of earlier trials at
        # this point, or worse than the best trial by a signed-rank test).
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"running median {running:.3f}x after {k + 1} pairs without compilation")


class Objective:
    """One trial per call: the plan of its picks, measured and compared, recorded in the study and `records`.
    Each trial adds the baseline's losses it saw to `measuring.baseline_losses` (each trial's numerics check reads
    them); `measured` holds the plans measured so far, so that a repeat is recorded without running."""

    def __init__(self, space: Space, measuring: Measuring, *, measured: dict[str, Measured], per_pair: bool = False,
                 on_trial: Callable[[TrialRecord], None] | None = None, study: optuna.Study | None = None) -> None:
        self.space, self.measuring, self.options = space, measuring, measuring.options
        self.measured, self.per_pair, self.on_trial = measured, per_pair, on_trial
        self.study = study  # shared with other workers: a plan one of them started first is theirs to measure
        self.records: list[TrialRecord] = []

    def __call__(self, trial: optuna.Trial) -> float:
        if self._surplus(trial):
            trial.set_user_attr("surplus", True)  # not recorded, not counted: Optuna's FAIL, with no state of ours
            raise Failed(f"the study holds its {self.options.trials} trials (another worker started the last one)")
        picks = {c.id: trial.suggest_categorical(c.id, [OFF] + [str(i) for i in range(len(self.space.options[c.id]))])
                 for c in self.space.candidates}
        t0 = time.perf_counter()
        try:
            plan = plan_for(self.space, picks)
        except ValueError as exc:
            return self._finish(trial, TrialRecord(number=trial.number, plan=Plan(), state=TrialState.INVALID,
                                                   reason=f"invalid combination: {exc}"), fail=True)
        trial.set_user_attr("plan", plan.model_dump(mode="json"))
        trial.set_user_attr("description", plan.describe())
        trial.set_user_attr("class", plan.effects())
        if not plan.actions:  # every candidate off: the baseline itself, by definition 1.0
            return self._finish(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.REPEATED,
                                                   value=1.0, speedup=1.0,
                                                   reason="no change: the baseline itself, not run"))
        key = plan.key()
        trial.set_user_attr("plan_key", key)
        if key in self.measured:
            return self._repeat(trial, plan, self.measured[key])
        first = self._started_elsewhere(trial, key)
        if first is not None:
            trial.set_user_attr("repeat_of", first)
            return self._finish(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.REPEATED,
                                                   reason=f"same plan as trial {first}, started first by another "
                                                   "worker: not run again"), fail=True)
        invalid = invalid_for_devices(plan, self.options)
        if invalid:
            return self._finish(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.INVALID,
                                                   reason=invalid), fail=True)
        return self._measure(trial, plan, t0)

    def _surplus(self, trial: optuna.Trial) -> bool:
        """Whether a trial just started is one too many: workers that looked at the count at the same instant each
        started one, and the trials numbered before it (measured, or running) already make the budget. A queued
        trial (a seed, a retry) runs all the same."""
        if self.study is None:
            return False
        study, budget = self.study, self.options.trials
        if study._storage.get_trial(trial._trial_id).system_attrs.get("fixed_params"):
            return False
        ahead = 0
        for t in study.get_trials(deepcopy=False):
            if t.number >= trial.number or "repeat_of" in t.user_attrs:
                continue
            running = t.state == optuna.trial.TrialState.RUNNING
            if running and not orphan(t, storage.GRACE_S) and not t.user_attrs.get("surplus"):
                ahead += 1
            elif t.state.is_finished() and t.user_attrs.get("state") in MEASURED:
                ahead += 1
        return ahead >= budget

    def _started_elsewhere(self, trial: optuna.Trial, key: str) -> int | None:
        """Another trial of the same plan that another worker measures or measured, so this one does not; None when
        this trial is to measure it. Two workers may choose one plan at the same instant and the storage orders
        writes, not decisions, so a trial writes three marks: its plan key, `claimed`, then `measuring`. Before
        claiming it waits for any claimed trial to decide; after claiming it yields to any lower-numbered trial of
        the plan. Of two trials, the one whose re-check missed the other's key claimed before the other checked,
        so the other saw the claim, waited for its decision and yields to it: at most one measures, and the lowest
        undecided one always does."""
        if self.study is None:
            return None
        deadline = time.monotonic() + DECIDE_WAIT_S
        while True:
            others = self._same_plan(trial, key)
            first = next((t.number for t in others if t.user_attrs.get("measuring")
                          or (t.state.is_finished() and t.user_attrs.get("state"))), None)
            if first is not None:
                return first
            deciding = [t for t in others if t.user_attrs.get("claimed") and t.state == _RUNNING]
            if not deciding or time.monotonic() > deadline:  # a worker killed between its marks decides nothing
                break
            time.sleep(0.05)
        trial.set_user_attr("claimed", True)
        lower = next((t.number for t in self._same_plan(trial, key) if t.number < trial.number), None)
        if lower is not None:
            return lower
        trial.set_user_attr("measuring", True)
        return None

    def _same_plan(self, trial: optuna.Trial, key: str) -> list[optuna.trial.FrozenTrial]:
        """The other trials of this plan that have not yielded: running ones, or finished ones with our state (a
        killed trial, failed with none of our state, is not one: its retry runs the plan)."""
        return [t for t in self.study.get_trials(deepcopy=False)
                if t.number != trial.number and t.user_attrs.get("plan_key") == key and "repeat_of" not in t.user_attrs
                and (t.state == _RUNNING or (t.state.is_finished() and t.user_attrs.get("state")))]

    def _repeat(self, trial: optuna.Trial, plan: Plan, earlier: Measured) -> float:
        """A plan measured before: its figures again, not its time."""
        trial.set_user_attr("repeat_of", earlier.number)
        for step, value in earlier.reported.items():  # its pairs, so a pruner comparing with the best finds them
            trial.report(value, step)
        for name, value in earlier.constraints.items():
            trial.set_constraint(name, value)
        if earlier.pruned:  # TPE proposed it again: it stays pruned rather than costing a trial's time again
            self._pruned(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.PRUNED,
                                            reason=f"same plan as trial {earlier.number}, pruned: not run again"),
                         earlier.reported)
        record = TrialRecord(number=trial.number, plan=plan, state=TrialState.REPEATED, value=earlier.value,
                             reason=f"same plan as trial {earlier.number}: not run again")
        return self._finish(trial, record, fail=earlier.value is None)

    def _measure(self, trial: optuna.Trial, plan: Plan, t0: float) -> float:
        report = PairReport(trial, plan, self.measuring, self.per_pair)
        try:
            a, b, cand = self.measuring.runner.measure(plan, f"trial-{trial.number}", self.options.steps, report=report)
        except optuna.TrialPruned as exc:
            self._pruned(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.PRUNED, reason=str(exc),
                                            duration_s=time.perf_counter() - t0), report.reported)
        except TrialFailed as exc:
            if exc.kind == "no_change":  # its programs are the baseline's: pruned after its warm-up, never timed
                self._pruned(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.PRUNED,
                                                reason=exc.message, duration_s=time.perf_counter() - t0), {})
            failed = TrialRecord(number=trial.number, plan=plan, state=TrialState.FAILED,
                                 reason=f"{exc.kind}: {exc.message.splitlines()[0][:300]}",
                                 duration_s=time.perf_counter() - t0)
            if exc.kind != "out_of_memory":
                return self._finish(trial, failed, fail=True)
            # A memory limit, not an accident: a completed, infeasible trial that TPE learns to steer away from.
            trial.set_constraint(OUT_OF_MEMORY, 1.0)
            return self._finish(trial, failed, objective=0.0, reported=report.reported)
        warm_s = getattr(cand, "warm_s", None)  # a measuring double may not time its warm-up
        baseline, known = self.measuring.runner.baseline, self.measuring.baseline_losses
        losses_by_step(baseline.steps if baseline else a, into=known)
        # Numerics already in the search: the candidate's losses against the baseline's at the same steps.
        compared = self.measuring.compare(a, b, plan, losses=aligned_losses(known, cand.steps))
        numerics, _ = compared.numerics()
        speed, memory_ratio = compared.ratio, compared.memory_ratio
        trial.set_user_attr("speedup", speed)
        trial.set_user_attr("speedup_ci95", list(compared.interval()))  # the search's pairs; verification is stricter
        trial.set_user_attr("pairs", len(compared.ratios))
        trial.set_user_attr("compiling_pairs", len(a) - len(compared.ratios))  # left out (unless fewer than 3 remained)
        trial.set_user_attr("per_sample", compared.per_sample)
        trial.set_user_attr("memory_ratio", memory_ratio)
        trial.set_user_attr("warmup_s", warm_s)
        if numerics is not None:
            trial.set_constraint(NUMERICS, numerics_margin(numerics))
            trial.set_user_attr("numerics", numerics.reason)
        if numerics is not None and not numerics.passed:
            # Objective 0 as well as infeasible: optuna-dashboard's best trial (the storage's) ignores constraints.
            return self._finish(trial, TrialRecord(number=trial.number, plan=plan, state=TrialState.NUMERICS,
                                                   value=0.0, speedup=speed, memory_ratio=memory_ratio,
                                                   duration_s=time.perf_counter() - t0, warmup_s=warm_s,
                                                   reason=numerics.reason),
                                reported=report.reported)
        trial.set_user_attr("candidate_losses", losses_of(b))
        ranks = rank_memory_line(a, b)
        per_rank = list(zip(rank_memory(a), rank_memory(b))) if ranks is not None else None
        if per_rank is not None:
            trial.set_user_attr("rank_memory", per_rank)
        record = TrialRecord(number=trial.number, plan=plan, state=TrialState.COMPLETE,
                             value=objective_value(self.options, speed, memory_ratio), speedup=speed,
                             memory_ratio=memory_ratio, duration_s=time.perf_counter() - t0, warmup_s=warm_s,
                             reason="; ".join([*cand.notes, *([ranks] if ranks else [])]), rank_memory=per_rank)
        return self._finish(trial, record, reported=report.reported)

    def _pruned(self, trial: optuna.Trial, record: TrialRecord, reported: dict[int, float]) -> NoReturn:
        trial.set_user_attr("state", record.state.value)
        trial.set_user_attr("reason", record.reason)
        self._recorded(record)
        self.measured.setdefault(record.plan.key(), Measured(trial.number, None, {}, dict(reported), pruned=True))
        raise optuna.TrialPruned(record.reason)

    def _finish(self, trial: optuna.Trial, record: TrialRecord, fail: bool = False, objective: float | None = None,
                reported: dict[int, float] | None = None) -> float:
        value = record.value if objective is None else objective
        trial.set_user_attr("state", record.state.value)
        trial.set_user_attr("reason", record.reason)
        constraints = trial.constraints
        if constraints:  # optuna-dashboard 0.21 shows only the pre-5 list of constraints: as attributes too
            trial.set_user_attr("constraints", constraints)
            trial.set_user_attr("feasible", all(v <= 0.0 for v in constraints.values()))
        self._recorded(record)
        if record.state != TrialState.REPEATED and record.plan.actions:
            self.measured.setdefault(record.plan.key(), Measured(trial.number, None if fail else value,
                                                                 dict(trial.constraints), dict(reported or {})))
        if fail:
            raise Failed(record.reason)
        return value

    def _recorded(self, record: TrialRecord) -> None:
        record.host = socket.gethostname()
        self.records.append(record)
        if self.on_trial:
            self.on_trial(record)
