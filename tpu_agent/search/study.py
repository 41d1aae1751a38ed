"""The Optuna study: one categorical choice per candidate ("off" included), each trial a plan measured in turns
with a warm baseline; invalid and repeated plans are recorded without running, failures without stopping."""

from __future__ import annotations

import math
import re
import shlex
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.errors import InputError
from tpu_agent.measure.numerics import check_plan_numerics
from tpu_agent.measure.runner import Runner, batch_size, losses_of, median, steady
from tpu_agent.measure.stats import median_ci
from tpu_agent.measure.trials import TrialFailed
from tpu_agent.plan.actions import Plan
from tpu_agent.search.records import TrialRecord
from tpu_agent.search.space import OFF, Space

STUDY_DB = "studies.db"
_COMPLETE = optuna.trial.TrialState.COMPLETE
_PRUNED = optuna.trial.TrialState.PRUNED


def storage_url(options: TuneOptions, runs_root: Path) -> str:
    return options.storage or f"sqlite:///{(runs_root.parent / STUDY_DB).resolve()}"


def redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):([^@]+)@", r"//\1:***@", url)


def dashboard_command(url: str) -> str:
    """The one command that opens the study's storage in optuna-dashboard (`pip install 'tpu-agent[dashboard]'`);
    a password in the URL is shown as ***."""
    return f"optuna-dashboard {shlex.quote(redact(url))}"


class Pruner(optuna.pruners.BasePruner):
    """One of Optuna's pruners, asked only about a trial slower than the baseline so far (its running median of
    pair ratios under 1.0) unless `below_baseline_only` is off. What it reads at pair i: the median pruner a
    running value (the median of the ratios so far), WilcoxonPruner each pair's own ratio (`per_pair`), which it
    matches by pair index with the best trial's."""

    def __init__(self, name: str, inner: optuna.pruners.BasePruner, *, per_pair: bool = False,
                 below_baseline_only: bool = True) -> None:
        self.name, self.inner, self.per_pair, self.below_baseline_only = name, inner, per_pair, below_baseline_only

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        values = trial.intermediate_values
        if not values:
            return False
        running = median(list(values.values())) if self.per_pair else values[max(values)]
        if self.below_baseline_only and running >= 1.0:
            return False
        with warnings.catch_warnings():  # WilcoxonPruner warns while the best trial has no pairs (the baseline)
            warnings.simplefilter("ignore")
            return self.inner.prune(study, trial)


def _wilcoxon():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.pruners.WilcoxonPruner(p_threshold=0.1, n_startup_steps=4)


# Timings on a shared machine are noisy: judge only after 4 pairs (and, for the median, 4 finished trials).
# benchmarks/pruners.py compares them on the examples (figures in the README, "Pruning"): the median pruner is
# kept; WilcoxonPruner saved time only by judging before 4 trials had finished, and so pruned a plan that
# measured 1.115x in full.
PRUNERS = {
    "median": lambda: Pruner("median", optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=3)),
    "wilcoxon": lambda: Pruner("wilcoxon", _wilcoxon(), per_pair=True),
    # also prunes a trial faster than the baseline when it is worse than the best trial
    "wilcoxon-best": lambda: Pruner("wilcoxon-best", _wilcoxon(), per_pair=True, below_baseline_only=False),
    "none": lambda: Pruner("none", optuna.pruners.NopPruner()),
}
PRUNER = "median"


# Core constraints (Trial.set_constraint): a trial is feasible when every value is <= 0. TPE then ranks an
# infeasible trial below every feasible one, best_trial skips it, and the dashboard shows it as infeasible.
NUMERICS = "numerics"  # how far the losses are beyond the check's tolerance (relative loss difference - tolerance)
OUT_OF_MEMORY = "out_of_memory"  # 1: the plan ran out of device memory (nothing else measured)
_NO_FINITE = 1e9  # a non-finite loss: JSON (the storage, the dashboard) cannot carry infinity


def numerics_margin(check) -> float:
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


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    return all(v <= 0.0 for v in trial.constraints.values())


HEARTBEAT_S = 30  # a RUNNING trial whose process stopped beating this long ago (kill -9) is failed as stale
GRACE_S = 90


def _storage(url: str):
    """An RDB URL gets Optuna's heartbeat: a trial left RUNNING by a killed tune is failed at the next trial."""
    if "://" not in url:
        return url
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)


def _fail_stale(study: optuna.Study) -> None:
    """Trials whose tune stopped beating (kill -9, a lost host) are failed now, before resume counts them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # nothing for a storage without a heartbeat


def open_study(options: TuneOptions, name: str, fingerprint: str, runs_root: Path, *,
               pruner: str = PRUNER, about: dict | None = None) -> optuna.Study:
    """The study `name` in the storage (created, or loaded for --resume); `about` goes into a new study's
    user attributes, so the study reads well in optuna-dashboard."""
    storage = storage_url(options, runs_root)
    try:
        backend = _storage(storage)
        existing = optuna.study.get_all_study_names(storage=backend)
    except Exception as exc:  # noqa: BLE001 - any backend failure: one clear line
        raise InputError(f"cannot open the study storage {redact(storage)}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}") from None
    if name in existing:
        study = optuna.load_study(study_name=name, storage=backend)
        study.pruner = PRUNERS.get(study.user_attrs.get("pruner"), PRUNERS[pruner])()  # as it was made with
        _fail_stale(study)
        return _checked(study, options, name, fingerprint)
    if options.resume and options.study:
        shown = ", ".join(repr(n) for n in sorted(existing)[:8]) or "none"
        raise InputError(f"--resume: there is no study {name!r} in {redact(storage)} (studies there: {shown})")
    sampler = optuna.samplers.TPESampler(seed=options.seed)
    pruning = PRUNERS[pruner]()
    try:
        study = optuna.create_study(study_name=name, storage=backend, direction="maximize",
                                    sampler=sampler, pruner=pruning)
    except optuna.exceptions.DuplicatedStudyError:  # another tune created it since we looked: share it
        return _checked(optuna.load_study(study_name=name, storage=backend, sampler=sampler, pruner=pruning),
                        options, name, fingerprint, wait_s=10.0)
    study.set_user_attr("fingerprint", fingerprint)
    for key, value in {"objective": options.objective, "target": options.target, "pruner": pruner,
                       **(about or {})}.items():
        study.set_user_attr(key, value)
    return study


def _checked(study: optuna.Study, options: TuneOptions, name: str, fingerprint: str,
             wait_s: float = 0.0) -> optuna.Study:
    """The study, if it was made with the same settings (a study created this instant gets `wait_s` for its
    creator to write them)."""
    deadline = time.monotonic() + wait_s
    theirs = study.user_attrs.get("fingerprint")
    while theirs is None and time.monotonic() < deadline:
        time.sleep(0.1)
        theirs = study.user_attrs.get("fingerprint")
    if theirs is None and wait_s:
        study.set_user_attr("fingerprint", fingerprint)
        theirs = fingerprint
    if theirs != fingerprint:
        raise InputError(f"study {name!r} exists with different settings (script, args or measuring "
                         "options); pick another --study name")
    if not options.resume and counted(study):
        raise InputError(f"study {name!r} already has {len(counted(study))} trials; pass --resume to continue it")
    return study


def counted(study: optuna.Study) -> list:
    """The trials that ran to an end we recorded: a trial interrupted by Ctrl-C or left by a killed tune
    (failed by Optuna, with no state of ours) does not count against --trials and is run again."""
    return [t for t in study.trials if t.state.is_finished() and t.user_attrs.get("state")]


def _objective_value(options: TuneOptions, speed: float | None, memory_ratio: float | None) -> float:
    if options.objective == "time":
        return speed or 0.0
    if options.objective == "memory":
        return (1.0 / memory_ratio) if memory_ratio else 0.0
    return (speed or 0.0) * ((1.0 / memory_ratio) if memory_ratio else 1.0)


def _invalid_for_devices(plan: Plan, options: TuneOptions) -> str | None:
    mesh = plan.mesh
    if mesh is None or mesh.devices <= options.devices:
        return None
    return f"invalid combination: mesh {dict(mesh.axes)} needs {mesh.devices} devices, {options.devices} available"


def steady_ratios(a, b, scale: float) -> list[float]:
    """Baseline / candidate time of each pair in which neither process compiled (warm-up can end before XLA's
    last compile: examples/mlp.py compiled in each of its first 8 steps, at 4x the steady step time)."""
    return [scale * x.wall_s / y.wall_s for x, y in zip(a, b) if not (x.compiled or y.compiled)]


class _Failed(Exception):
    """A trial that could not produce a value: Optuna records it as FAIL and goes on."""


@dataclass
class _Measured:
    """A plan measured before (this run or an earlier one): what a repeat of it records without running."""

    number: int
    value: float | None  # None: it failed or was pruned
    constraints: dict[str, float] = field(default_factory=dict)
    reported: dict[int, float] = field(default_factory=dict)  # its intermediate values, step -> value
    pruned: bool = False


def search(study: optuna.Study, space: Space, runner: Runner, options: TuneOptions, baseline_batch: int | None,
           baseline_losses: dict[int, float], on_trial=None) -> list[TrialRecord]:
    """Run the Optuna study; every finished trial is in the study's storage as it ends."""
    records: list[TrialRecord] = []
    per_pair = getattr(study.pruner, "per_pair", False)
    measured = {t.user_attrs["plan_key"]: _Measured(t.number, t.value if t.state == _COMPLETE else None,
                                                     dict(t.constraints), dict(t.intermediate_values),
                                                     pruned=t.state == _PRUNED)
                for t in counted(study) if t.state in (_COMPLETE, _PRUNED, optuna.trial.TrialState.FAIL)
                and t.user_attrs.get("plan_key")}

    def _pruned(trial, record: TrialRecord, reported: dict[int, float]):
        trial.set_user_attr("state", record.state)
        trial.set_user_attr("reason", record.reason)
        records.append(record)
        if on_trial:
            on_trial(record)
        measured.setdefault(record.plan.key(), _Measured(trial.number, None, {}, dict(reported), pruned=True))
        raise optuna.TrialPruned(record.reason)

    def objective(trial: optuna.Trial) -> float:
        picks = {c.id: trial.suggest_categorical(c.id, [OFF] + [str(i) for i in range(len(space.options[c.id]))])
                 for c in space.candidates}
        t0 = time.perf_counter()
        try:
            plan = space.plan_for(picks)
        except ValueError as exc:
            return _finish(trial, TrialRecord(number=trial.number, plan=Plan(), state="invalid",
                                              reason=f"invalid combination: {exc}"), fail=True)
        trial.set_user_attr("plan", plan.model_dump(mode="json"))
        trial.set_user_attr("description", plan.describe())
        trial.set_user_attr("class", plan.effects())
        if not plan.actions:  # every candidate off: the baseline itself, by definition 1.0
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="repeated", value=1.0,
                                              speedup=1.0, reason="no change: the baseline itself, not run"))
        key = plan.key()
        trial.set_user_attr("plan_key", key)
        if key in measured:
            earlier = measured[key]
            for step, value in earlier.reported.items():  # its pairs, so a pruner comparing with the best finds them
                trial.report(value, step)
            for name, value in earlier.constraints.items():
                trial.set_constraint(name, value)
            if earlier.pruned:  # TPE proposed it again: it stays pruned rather than costing a trial's time again
                _pruned(trial, TrialRecord(number=trial.number, plan=plan, state="pruned",
                                           reason=f"same plan as trial {earlier.number}, pruned: not run again"),
                        earlier.reported)
            record = TrialRecord(number=trial.number, plan=plan, state="repeated",
                                 value=earlier.value, reason=f"same plan as trial {earlier.number}: not run again")
            return _finish(trial, record, fail=earlier.value is None)
        invalid = _invalid_for_devices(plan, options)
        if invalid:
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="invalid", reason=invalid), fail=True)

        cand_batch = batch_size(plan, baseline_batch)
        per_sample = baseline_batch is not None and cand_batch != baseline_batch
        scale = (cand_batch / baseline_batch) if per_sample else 1.0  # time per sample when the batch grows
        reported: dict[int, float] = {}

        def report(i, a, b):
            if a[-1].compiled or b[-1].compiled:  # a compiling step says nothing of the steady state: not judged
                return
            kept = steady_ratios(a, b, scale)
            k, running = len(kept) - 1, median(kept)
            reported[k] = kept[-1] if per_pair else running
            trial.report(reported[k], k)
            # Clearly slow: slower than the baseline, and the pruner says so (under the median of earlier trials at
            # this point, or worse than the best trial by a signed-rank test).
            if trial.should_prune():
                raise optuna.TrialPruned(f"running median {running:.3f}x after {k + 1} pairs without compilation")

        try:
            a, b, cand = runner.measure(plan, f"trial-{trial.number}", options.steps, report=report)
        except optuna.TrialPruned as exc:
            _pruned(trial, TrialRecord(number=trial.number, plan=plan, state="pruned", reason=str(exc),
                                       duration_s=time.perf_counter() - t0), reported)
        except TrialFailed as exc:
            failed = TrialRecord(number=trial.number, plan=plan, state="failed",
                                 reason=f"{exc.kind}: {exc.message.splitlines()[0][:300]}",
                                 duration_s=time.perf_counter() - t0)
            if exc.kind != "out_of_memory":
                return _finish(trial, failed, fail=True)
            # A memory limit, not an accident: a completed, infeasible trial that TPE learns to steer away from.
            trial.set_constraint(OUT_OF_MEMORY, 1.0)
            return _finish(trial, failed, objective=0.0, reported=reported)
        warm_s = getattr(cand, "warm_s", None)  # a measuring double may not time its warm-up
        for s in runner.baseline.steps if runner.baseline else a:
            if s.loss is not None:
                baseline_losses.setdefault(s.step, s.loss)
        steady_a, steady_b = steady(a, b)  # compiling throughout: all pairs, said in the trial's attributes
        ratios = [scale * x.wall_s / y.wall_s for x, y in zip(steady_a, steady_b)]
        compiling = len(a) - len(ratios)
        speed = median(ratios)
        # Numerics already in the search: the candidate's losses against the baseline's at the same steps.
        pairs_ = [(baseline_losses[s.step], s.loss) for s in cand.steps if s.loss is not None and s.step in baseline_losses]
        numerics = check_plan_numerics(plan, [p[0] for p in pairs_], [p[1] for p in pairs_], options)[0] \
            if pairs_ else None
        mem_a = median([s.device_bytes for s in a])
        mem_b = median([s.device_bytes for s in b])
        memory_ratio = (mem_b / mem_a) if mem_a else None
        value = _objective_value(options, speed, memory_ratio)
        low, high = median_ci(np.asarray(ratios), seed=options.seed)
        trial.set_user_attr("speedup", speed)
        trial.set_user_attr("speedup_ci95", [low, high])  # of this trial's search pairs; verification is stricter
        trial.set_user_attr("pairs", len(ratios))
        trial.set_user_attr("compiling_pairs", compiling)  # left out of the speedup (unless fewer than 3 remained)
        trial.set_user_attr("per_sample", per_sample)
        trial.set_user_attr("memory_ratio", memory_ratio)
        trial.set_user_attr("warmup_s", warm_s)
        if numerics is not None:
            trial.set_constraint(NUMERICS, numerics_margin(numerics))
            trial.set_user_attr("numerics", numerics.reason)
        if numerics is not None and not numerics.passed:
            # Objective 0 as well as infeasible: optuna-dashboard's best trial (the storage's) ignores constraints.
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="numerics", value=0.0,
                                              speedup=speed, memory_ratio=memory_ratio,
                                              duration_s=time.perf_counter() - t0, warmup_s=warm_s,
                                              reason=numerics.reason),
                           reported=reported)
        trial.set_user_attr("candidate_losses", losses_of(b))
        record = TrialRecord(number=trial.number, plan=plan, state="complete", value=value, speedup=speed,
                             memory_ratio=memory_ratio, duration_s=time.perf_counter() - t0,
                             warmup_s=warm_s, reason="; ".join(cand.notes))
        return _finish(trial, record, reported=reported)

    def _finish(trial, record: TrialRecord, fail: bool = False, objective: float | None = None,
                reported: dict[int, float] | None = None):
        value = record.value if objective is None else objective
        trial.set_user_attr("state", record.state)
        trial.set_user_attr("reason", record.reason)
        constraints = trial.constraints
        if constraints:  # optuna-dashboard 0.21 shows only the pre-5 list of constraints: as attributes too
            trial.set_user_attr("constraints", constraints)
            trial.set_user_attr("feasible", all(v <= 0.0 for v in constraints.values()))
        records.append(record)
        if on_trial:
            on_trial(record)
        if record.state != "repeated" and record.plan.actions:
            measured.setdefault(record.plan.key(), _Measured(trial.number, None if fail else value,
                                                             dict(trial.constraints), dict(reported or {})))
        if fail:
            raise _Failed(record.reason)
        return value

    done = len(counted(study))
    remaining = max(options.trials - done, 0)
    if remaining:
        study.optimize(objective, n_trials=remaining, timeout=options.timeout, catch=(_Failed,),
                       gc_after_trial=False)
    return records


def earlier_records(study: optuna.Study) -> list[TrialRecord]:
    """The trials an earlier run of the study recorded, as this run's report lists them."""
    out = []
    for t in counted(study):
        attrs = t.user_attrs
        try:
            plan = Plan.model_validate(attrs.get("plan") or {"actions": []})
        except ValueError:
            continue
        speedup = attrs.get("speedup")
        if speedup is None and attrs.get("state") == "repeated":
            speedup = t.value
        out.append(TrialRecord(number=t.number, plan=plan, state=attrs["state"], value=t.value, speedup=speedup,
                               memory_ratio=attrs.get("memory_ratio"), reason=attrs.get("reason", ""),
                               earlier=True))
    return out


def ranked_plans(study: optuna.Study) -> list[Plan]:
    """The feasible plans (numerics passed, memory enough) the search measured faster than the baseline, best
    first, each once."""
    done = [t for t in study.trials if t.state == _COMPLETE and t.value is not None and feasible(t)
            and t.user_attrs.get("plan")]
    done.sort(key=lambda t: t.value, reverse=True)
    plans, seen = [], set()
    for t in done:
        plan = Plan.model_validate(t.user_attrs["plan"])
        if not plan.actions or plan.key() in seen:
            continue
        if t.value <= 1.0:
            break
        seen.add(plan.key())
        plans.append(plan)
    return plans


def note_verdicts(study: optuna.Study, verdicts: list, best) -> None:
    """The verification's outcome in the study's user attributes, so the study reads well outside our report
    (optuna-dashboard): each verified plan with its speedup and 95 % CI, and the one kept (or none)."""

    def brief(verdict) -> dict:
        out = {"plan": verdict.plan.describe(), "accepted": verdict.accepted, "reason": verdict.reason}
        out["class"] = verdict.plan.effects()
        if verdict.speed is not None:
            out.update(speedup=verdict.speed.speedup, ci95=[verdict.speed.ci_low, verdict.speed.ci_high],
                       pairs=verdict.speed.pairs, per_sample=verdict.speed.per_sample)
        if verdict.memory is not None:
            out.update(memory_saving=verdict.memory.saving, memory_ci95=[verdict.memory.ci_low, verdict.memory.ci_high])
        return out

    study.set_user_attr("verifications", [brief(v) for v in verdicts])
    study.set_user_attr("verified", brief(best) if best is not None else None)
