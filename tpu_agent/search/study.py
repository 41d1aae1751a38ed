"""The Optuna study: one categorical choice per candidate ("off" included), each trial a plan measured in turns
with a warm baseline; invalid and repeated plans are recorded without running, failures without stopping."""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import optuna
from pydantic import BaseModel

from tpu_agent.config import TuneOptions
from tpu_agent.errors import InputError
from tpu_agent.plan.actions import Plan
from tpu_agent.propose.base import Candidate, ProposalRound, TrialOutcome
from tpu_agent.search.measure import Runner, batch_size, losses_of, median
from tpu_agent.search.trials import TrialFailed
from tpu_agent.verify.stats import check_numerics

STUDY_DB = "studies.db"
OFF = "off"

# complete: measured; numerics: measured, losses off; repeated: a plan measured before, not run again
TrialState = Literal["complete", "numerics", "failed", "pruned", "invalid", "repeated"]
_OUTCOME = {"complete": "measured", "numerics": "rejected", "repeated": "measured"}


class TrialRecord(BaseModel):
    number: int
    plan: Plan
    state: TrialState
    value: float | None = None
    speedup: float | None = None
    memory_ratio: float | None = None
    reason: str = ""
    duration_s: float = 0.0
    earlier: bool = False  # recorded by an earlier run of the study (--resume)

    def outcome(self) -> TrialOutcome:
        """The trial as the proposers read it."""
        return TrialOutcome(number=self.number, actions=[a.model_dump(mode="json") for a in self.plan.actions],
                            status=_OUTCOME.get(self.state, self.state), speedup=self.speedup,
                            loss_ok=self.state != "numerics", note=self.reason or None)


@dataclass
class Space:
    """The candidates whose options span the search, with their option lists."""

    candidates: list[Candidate]
    options: dict[str, list[tuple]] = field(default_factory=dict)

    def plan_for(self, picks: dict[str, str]) -> Plan:
        actions = []
        for cand in self.candidates:
            pick = picks.get(cand.id, OFF)
            if pick != OFF:
                actions.extend(self.options[cand.id][int(pick)])
        return Plan(actions=actions)


def build_space(round_: ProposalRound, limit: int, previous: Space | None = None) -> Space:
    """The top candidates (and their options) that the search will combine; earlier rounds' stay."""
    chosen = list(previous.candidates) if previous else []
    options = dict(previous.options) if previous else {}
    limit += len(chosen)
    for cand in round_.candidates:
        if cand.id in options:
            continue
        try:
            opts = cand.options()
        except ValueError:
            continue
        if not opts:
            continue
        chosen.append(cand)
        options[cand.id] = opts
        if len(chosen) >= limit:
            break
    return Space(candidates=chosen, options=options)


def storage_url(options: TuneOptions, runs_root: Path) -> str:
    return options.storage or f"sqlite:///{(runs_root.parent / STUDY_DB).resolve()}"


def redact(url: str) -> str:
    return re.sub(r"//([^:/@]+):([^@]+)@", r"//\1:***@", url)


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


def open_study(options: TuneOptions, name: str, fingerprint: str, runs_root: Path) -> optuna.Study:
    storage = storage_url(options, runs_root)
    try:
        backend = _storage(storage)
        existing = optuna.study.get_all_study_names(storage=backend)
    except Exception as exc:  # noqa: BLE001 - any backend failure: one clear line
        raise InputError(f"cannot open the study storage {redact(storage)}: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}") from None
    if name in existing:
        study = optuna.load_study(study_name=name, storage=backend)
        _fail_stale(study)
        return _checked(study, options, name, fingerprint)
    if options.resume and options.study:
        shown = ", ".join(repr(n) for n in sorted(existing)[:8]) or "none"
        raise InputError(f"--resume: there is no study {name!r} in {redact(storage)} (studies there: {shown})")
    sampler = optuna.samplers.TPESampler(seed=options.seed)
    # Timings on a shared machine are noisy: judge only after 4 pairs and 4 finished trials.
    pruner = optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=3)
    try:
        study = optuna.create_study(study_name=name, storage=backend, direction="maximize",
                                    sampler=sampler, pruner=pruner)
    except optuna.exceptions.DuplicatedStudyError:  # another tune created it since we looked: share it
        return _checked(optuna.load_study(study_name=name, storage=backend, sampler=sampler, pruner=pruner),
                        options, name, fingerprint, wait_s=10.0)
    study.set_user_attr("fingerprint", fingerprint)
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


class _Failed(Exception):
    """A trial that could not produce a value: Optuna records it as FAIL and goes on."""


def search(study: optuna.Study, space: Space, runner: Runner, options: TuneOptions, baseline_batch: int | None,
           baseline_losses: dict[int, float], on_trial=None) -> list[TrialRecord]:
    """Run the Optuna study; every finished trial is in the study's storage as it ends."""
    records: list[TrialRecord] = []
    # Plans already measured (this run or an earlier one of the study): plan key -> (trial number, value).
    measured = {t.user_attrs["plan_key"]: (t.number, t.value) for t in counted(study)
                if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
                and t.user_attrs.get("plan_key")}

    def objective(trial: optuna.Trial) -> float:
        picks = {c.id: trial.suggest_categorical(c.id, [OFF] + [str(i) for i in range(len(space.options[c.id]))])
                 for c in space.candidates}
        t0 = time.perf_counter()
        try:
            plan = space.plan_for(picks)
        except ValueError as exc:
            return _finish(trial, TrialRecord(number=trial.number, plan=Plan(), state="invalid",
                                              reason=f"invalid combination: {exc}"), fail=True)
        if not plan.actions:  # every candidate off: the baseline itself, by definition 1.0
            trial.set_user_attr("plan", plan.model_dump(mode="json"))
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="repeated", value=1.0,
                                              speedup=1.0, reason="no change: the baseline itself, not run"))
        key = plan.key()
        trial.set_user_attr("plan", plan.model_dump(mode="json"))
        trial.set_user_attr("plan_key", key)
        if key in measured:
            number, value = measured[key]
            record = TrialRecord(number=trial.number, plan=plan, state="repeated",
                                 value=value, reason=f"same plan as trial {number}: not run again")
            return _finish(trial, record, fail=value is None)
        invalid = _invalid_for_devices(plan, options)
        if invalid:
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="invalid", reason=invalid), fail=True)

        cand_batch = batch_size(plan, baseline_batch)
        per_sample = baseline_batch is not None and cand_batch != baseline_batch
        scale = (cand_batch / baseline_batch) if per_sample else 1.0  # time per sample when the batch grows

        def report(i, a, b):
            ratio = median([scale * x.wall_s / y.wall_s for x, y in zip(a, b)])
            trial.report(ratio, i)
            # Clearly slow: under the median of earlier trials at this point, and slower than the baseline.
            if ratio < 1.0 and trial.should_prune():
                raise optuna.TrialPruned(f"running median {ratio:.3f}x after {i + 1} pairs")

        try:
            a, b, cand = runner.measure(plan, f"trial-{trial.number}", options.steps, report=report)
        except optuna.TrialPruned as exc:
            record = TrialRecord(number=trial.number, plan=plan, state="pruned", reason=str(exc),
                                 duration_s=time.perf_counter() - t0)
            trial.set_user_attr("state", record.state)
            trial.set_user_attr("reason", record.reason)
            records.append(record)
            if on_trial:
                on_trial(record)
            raise
        except TrialFailed as exc:
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="failed",
                                              reason=f"{exc.kind}: {exc.message.splitlines()[0][:300]}",
                                              duration_s=time.perf_counter() - t0), fail=True)
        for s in runner.baseline.steps if runner.baseline else a:
            if s.loss is not None:
                baseline_losses.setdefault(s.step, s.loss)
        speed = median([scale * x.wall_s / y.wall_s for x, y in zip(a, b)])
        # Numerics already in the search: the candidate's losses against the baseline's at the same steps.
        pairs_ = [(baseline_losses[s.step], s.loss) for s in cand.steps if s.loss is not None and s.step in baseline_losses]
        numerics = check_numerics([p[0] for p in pairs_], [p[1] for p in pairs_],
                                  preserves_numerics=plan.preserves_numerics, loss_tol=options.loss_tol) if pairs_ else None
        mem_a = median([s.device_bytes for s in a])
        mem_b = median([s.device_bytes for s in b])
        memory_ratio = (mem_b / mem_a) if mem_a else None
        value = _objective_value(options, speed, memory_ratio)
        if numerics is not None and not numerics.passed:
            trial.set_user_attr("speedup", speed)
            return _finish(trial, TrialRecord(number=trial.number, plan=plan, state="numerics", value=0.0,
                                              speedup=speed, memory_ratio=memory_ratio,
                                              duration_s=time.perf_counter() - t0, reason=numerics.reason))
        trial.set_user_attr("speedup", speed)
        trial.set_user_attr("memory_ratio", memory_ratio)
        trial.set_user_attr("candidate_losses", losses_of(b))
        record = TrialRecord(number=trial.number, plan=plan, state="complete", value=value, speedup=speed,
                             memory_ratio=memory_ratio, duration_s=time.perf_counter() - t0,
                             reason="; ".join(cand.notes))
        return _finish(trial, record)

    def _finish(trial, record: TrialRecord, fail: bool = False):
        trial.set_user_attr("state", record.state)
        trial.set_user_attr("reason", record.reason)
        records.append(record)
        if on_trial:
            on_trial(record)
        if record.state != "repeated" and record.plan.actions:
            measured.setdefault(record.plan.key(), (trial.number, None if fail else record.value))
        if fail:
            raise _Failed(record.reason)
        return record.value

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
    """The plans the search measured faster than the baseline, best first, each once."""
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None
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
