"""The Optuna study: its storage (SQLite by default, any RDB URL to share), its pruners, the trials a dead worker
left, and what is read back from it: earlier trials, the ranked plans, the verdicts (search.loop runs it)."""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path

import optuna

from tpu_agent.config import TuneOptions, one_rank
from tpu_agent.errors import InputError
from tpu_agent.measure.compare import median
from tpu_agent.plan.actions import Plan
from tpu_agent.search import storage
from tpu_agent.search.objective import Measured
from tpu_agent.search.records import MEASURED, TrialRecord, TrialState
from tpu_agent.search.storage import (STUDY_DB, check_url, dashboard_command, first_line,  # noqa: F401
                                      open_storage, redact, retry_once, storage_url)
_COMPLETE = optuna.trial.TrialState.COMPLETE
_PRUNED = optuna.trial.TrialState.PRUNED
_RUNNING = optuna.trial.TrialState.RUNNING


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


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """Every constraint the objective set is met (numerics passed, memory enough)."""
    return all(v <= 0.0 for v in trial.constraints.values())


def owner() -> dict:
    """The tune process running a trial, recorded on the trial: a tune killed outright leaves it RUNNING, and the
    next tune on this host that opens the study sees the process gone."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _gone(owner: dict, own: bool = False) -> bool:
    """Whether a trial's process is gone: only this host's can be asked (another host's heartbeat says); our own
    pid counts as gone with `own` (between trials: a trial of ours still RUNNING was cut off by a lost storage)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    if owner["pid"] == os.getpid():
        return own
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def fail_stale(study: optuna.Study, own: bool = False) -> list[optuna.trial.FrozenTrial]:
    """Trials whose worker is gone (its process, on this host; or its heartbeat, anywhere: kill -9, a lost host)
    are failed now, and each is queued to run again, once (RetryHeartbeatStaleTrialCallback: a retry that is itself left
    running is not retried); an orphan (no worker ever wrote to it) past the heartbeat's grace is failed too. No
    trial stays RUNNING."""
    running = {t._trial_id for t in study.get_trials(deepcopy=False, states=(_RUNNING,))}
    if not running:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # the heartbeat's verdict, and its retry
    retry = retry_once()
    for t in study.get_trials(deepcopy=False, states=(_RUNNING,)):
        if storage.orphan(t, storage.GRACE_S):  # nothing picked, nothing to run again
            try:
                study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
        elif _gone(t.user_attrs.get("process") or {}, own):
            try:
                if study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL):
                    retry(study, study._storage.get_trial(t._trial_id))
            except optuna.exceptions.UpdateFinishedTrialError:  # another process failed it first
                pass
    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
            if t._trial_id in running]


def worker_key(script: Path, args: list[str], options: TuneOptions) -> dict:
    """What a worker on another host must share with the study: the script (its name and content), its args and
    the settings that decide what is measured and searched (not the script's path, which differs by host)."""
    import hashlib

    keep = options.model_dump(include={"steps", "warmup", "target", "objective", "min_gain", "loss_tol",
                                       "devices", "allow"})
    # None: one process as python runs it, as studies made before recorded it; 1: one torchrun rank (--nproc 1)
    keep["nproc"] = options.nproc if options.nproc > 1 or one_rank() else None
    return {"script": script.name, "sha256": hashlib.sha256(Path(script).read_bytes()).hexdigest()[:16],
            "args": list(args), "settings": keep}


def _differs(theirs: dict, ours: dict) -> str | None:
    """Which part of `worker_key` differs, in words; None when the study was made for this very run."""
    if theirs.get("script") != ours["script"]:
        return f"it was made for script {theirs.get('script')}, not {ours['script']}"
    if theirs.get("sha256") != ours["sha256"]:
        return f"it was made for another version of {ours['script']} (sha256 {theirs.get('sha256')}, here {ours['sha256']})"
    if theirs.get("args") != ours["args"]:
        return f"it was made for the script's arguments {theirs.get('args')}, not {ours['args']}"
    for key, value in ours["settings"].items():
        their = (theirs.get("settings") or {}).get(key)
        if their != value:
            what = "another search space" if key in ("allow", "devices", "nproc") else "other measuring settings"
            return f"it was made for {what}: --{key.replace('_', '-')} {their}, here {value}"
    return None


def open_study(options: TuneOptions, name: str, fingerprint: str, runs_root: Path, *,
               pruner: str = PRUNER, about: dict | None = None, key: dict | None = None,
               join: bool = False) -> optuna.Study:
    """The study `name` in the storage (created, or loaded for --resume or --join); `about` goes into a new
    study's user attributes, so the study reads well in optuna-dashboard; `key` (worker_key) is what a worker
    joining from another host must match."""
    storage = storage_url(options, runs_root)
    check_url(storage)
    try:
        backend = open_storage(storage)
        existing = optuna.study.get_all_study_names(storage=backend)
    except Exception as exc:  # noqa: BLE001 - any backend failure: one clear line
        raise InputError(f"cannot open the study storage {redact(storage)}: {first_line(exc, storage)}") from None
    if name in existing:
        study = optuna.load_study(study_name=name, storage=backend)
        study.pruner = PRUNERS.get(study.user_attrs.get("pruner"), PRUNERS[pruner])()  # as it was made with
        if join:
            why = _differs(study.user_attrs.get("worker") or {}, key) if key else None
            if why:
                raise InputError(f"--join: study {name!r} cannot take this worker: {why}")
            if "space" not in study.user_attrs:
                raise InputError(f"--join: study {name!r} has no search space yet (its first tune is still "
                                 "measuring its baseline, or it was made by an older tpu-agent); join once it "
                                 "has started searching")
            fail_stale(study)
            return study
        fail_stale(study)
        return _checked(study, options, name, fingerprint, key=key)
    if join or (options.resume and options.study):
        shown = ", ".join(repr(n) for n in sorted(existing)[:8]) or "none"
        flag = "--join" if join else "--resume"
        raise InputError(f"{flag}: there is no study {name!r} in {redact(storage)} (studies there: {shown})")
    sampler = optuna.samplers.TPESampler(seed=options.seed)
    pruning = PRUNERS[pruner]()
    try:
        study = optuna.create_study(study_name=name, storage=backend, direction="maximize",
                                    sampler=sampler, pruner=pruning)
    except optuna.exceptions.DuplicatedStudyError:  # another tune created it since we looked: share it
        return _checked(optuna.load_study(study_name=name, storage=backend, sampler=sampler, pruner=pruning),
                        options, name, fingerprint, wait_s=10.0)
    study.set_user_attr("fingerprint", fingerprint)
    for attr, value in {"objective": options.objective, "target": options.target, "pruner": pruner,
                        **({"worker": key} if key else {}), **(about or {})}.items():
        study.set_user_attr(attr, value)
    return study


def joined_study(script: Path, args: list[str], options: TuneOptions) -> optuna.Study:
    """The study `options.join`, opened for a worker (`--join`): bad input (no such study, another script or search
    space) is an InputError before any process starts or any run directory is made."""
    return open_study(options, options.join, "", options.runs_root(), key=worker_key(script, args, options), join=True)


def _checked(study: optuna.Study, options: TuneOptions, name: str, fingerprint: str,
             wait_s: float = 0.0, key: dict | None = None) -> optuna.Study:
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
        why = _differs(study.user_attrs.get("worker") or {}, key) if key and study.user_attrs.get("worker") else None
        raise InputError(f"study {name!r} exists with different settings ({why or 'script, args or measuring options'}); "
                         "pick another --study name")
    if not options.resume and recorded(study):
        raise InputError(f"study {name!r} already has {len(recorded(study))} trials; pass --resume to continue it")
    return study




def busy(study: optuna.Study) -> bool:
    """Whether a trial of the study runs or waits in its queue (on any worker)."""
    return bool(study.get_trials(deepcopy=False, states=(_RUNNING, optuna.trial.TrialState.WAITING)))


def recorded(study: optuna.Study) -> list:
    """The trials that ran to an end we recorded: a trial interrupted by Ctrl-C or left by a killed tune
    (failed by Optuna, with no state of ours) is not among them, and is run again."""
    return [t for t in study.trials if t.state.is_finished() and t.user_attrs.get("state")]


def counted(study: optuna.Study) -> list:
    """The trials that count against --trials: each measured a plan (a repeat, an invalid plan or the baseline
    itself is recorded but costs no measuring, and is not counted)."""
    return [t for t in recorded(study) if t.user_attrs.get("state") in MEASURED and "repeat_of" not in t.user_attrs]


def measured_plans(study: optuna.Study) -> dict[str, Measured]:
    """The plans the study measured, failed or pruned before: a repeat of one is recorded without running."""
    return {t.user_attrs["plan_key"]: Measured(t.number, t.value if t.state == _COMPLETE else None,
                                               dict(t.constraints), dict(t.intermediate_values),
                                               pruned=t.state == _PRUNED)
            for t in recorded(study) if t.state in (_COMPLETE, _PRUNED, optuna.trial.TrialState.FAIL)
            and t.user_attrs.get("plan_key")}


def record_of(t: optuna.trial.FrozenTrial, earlier: bool = True) -> TrialRecord | None:
    """A recorded trial as the report lists it (None: its plan no longer reads)."""
    attrs = t.user_attrs
    try:
        plan = Plan.model_validate(attrs.get("plan") or {"actions": []})
    except ValueError:
        return None
    speedup = attrs.get("speedup")
    if speedup is None and attrs.get("state") == TrialState.REPEATED:
        speedup = t.value
    return TrialRecord(number=t.number, plan=plan, state=attrs["state"], value=t.value, speedup=speedup,
                       memory_ratio=attrs.get("memory_ratio"), reason=attrs.get("reason", ""), earlier=earlier,
                       host=attrs.get("host"))


def earlier_records(study: optuna.Study) -> list[TrialRecord]:
    """The trials an earlier run of the study recorded, as this run's report lists them."""
    return [r for r in (record_of(t) for t in recorded(study)) if r is not None]


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


def hold_optuna_log():
    """Optuna's messages off stderr and held in memory until the run directory exists."""
    from logging.handlers import MemoryHandler

    optuna.logging.set_verbosity(optuna.logging.INFO)
    optuna.logging.disable_default_handler()
    held = MemoryHandler(capacity=10_000, flushLevel=100)  # above CRITICAL: flushed only when told
    optuna.logging.get_logger("optuna").addHandler(held)
    return held


def optuna_log_to(path: Path, held) -> None:
    """Optuna's messages (a failed trial's traceback among them) into the run directory, not on stderr."""
    import logging

    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger = optuna.logging.get_logger("optuna")
    held.setTarget(handler)
    held.flush()
    logger.removeHandler(held)
    logger.addHandler(handler)
