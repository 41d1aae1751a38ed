"""The Optuna study: its storage (SQLite by default, any RDB URL to share), its pruners, the search that runs it
(each trial the Objective's) and what is read back from it: earlier trials, the ranked plans, the verdicts."""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import socket
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.errors import InputError
from tpu_agent.measure.compare import median
from tpu_agent.measure.runner import Runner
from tpu_agent.plan.actions import Plan
from tpu_agent.search.objective import Failed, Measured, Objective
from tpu_agent.search.records import TrialRecord, TrialState
from tpu_agent.search.space import Space

STUDY_DB = "studies.db"
_COMPLETE = optuna.trial.TrialState.COMPLETE
_PRUNED = optuna.trial.TrialState.PRUNED
_RUNNING = optuna.trial.TrialState.RUNNING


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


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """Every constraint the objective set is met (numerics passed, memory enough)."""
    return all(v <= 0.0 for v in trial.constraints.values())


HEARTBEAT_S = 30  # a RUNNING trial whose process stopped beating this long ago (kill -9) is failed as stale
GRACE_S = 90
SQLITE_TIMEOUT_S = 60  # several tunes sharing one SQLite file wait their turn to write, not fail


def _storage(url: str):
    """An RDB URL gets Optuna's heartbeat: a trial left RUNNING by a killed tune is failed at the next trial.
    A SQLite file's tables are created under a file lock: tunes started together in a fresh folder would
    otherwise race on creating them (`table version_info already exists`)."""
    if "://" not in url:
        return url
    sqlite = url.startswith("sqlite:///") and url != "sqlite:///:memory:"
    with warnings.catch_warnings(), _file_lock(Path(url[len("sqlite:///"):] + ".lock") if sqlite else None):
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                          engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if sqlite
                                          else None)


@contextmanager
def _file_lock(path: Path | None):
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _owner() -> dict:
    """The tune process running a trial, recorded on the trial: a tune killed outright leaves it RUNNING, and the
    next tune on this host that opens the study sees the process gone."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _gone(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False  # another host's tune: its heartbeat says
    if owner["pid"] == os.getpid():
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _fail_stale(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Trials whose tune is gone (its process, on this host; or its heartbeat, anywhere: kill -9, a lost host) are
    failed now, before resume counts them, and each is queued to run again, once (a retry that is itself left
    running is not retried). No trial stays RUNNING."""
    running = {t._trial_id for t in study.get_trials(deepcopy=False, states=(_RUNNING,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # the heartbeat's verdict
    for t in study.get_trials(deepcopy=False, states=(_RUNNING,)):
        if _gone(t.user_attrs.get("process") or {}):
            try:
                study._storage.set_trial_state_values(t._trial_id, state=optuna.trial.TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:  # another process failed it first
                pass
    stale = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
             if t._trial_id in running]
    for t in stale:
        if t.params and "retry_of" not in t.user_attrs:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
    return stale


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


def search(study: optuna.Study, space: Space, runner: Runner, options: TuneOptions, baseline_batch: int | None,
           baseline_losses: dict[int, float], on_trial=None) -> list[TrialRecord]:
    """Run the Optuna study; every finished trial is in the study's storage as it ends."""
    objective = Objective(space, runner, options, baseline_batch, baseline_losses, measured=measured_plans(study),
                          per_pair=getattr(study.pruner, "per_pair", False), on_trial=on_trial)
    remaining = max(options.trials - len(counted(study)), 0)

    def owned(trial: optuna.Trial):
        trial.set_user_attr("process", _owner())  # a tune killed outright: the next open sees its process gone
        return objective(trial)

    if remaining:
        study.optimize(owned, n_trials=remaining, timeout=options.timeout, catch=(Failed,),
                       gc_after_trial=False)
    return objective.records


def measured_plans(study: optuna.Study) -> dict[str, Measured]:
    """The plans the study measured, failed or pruned before: a repeat of one is recorded without running."""
    return {t.user_attrs["plan_key"]: Measured(t.number, t.value if t.state == _COMPLETE else None,
                                               dict(t.constraints), dict(t.intermediate_values),
                                               pruned=t.state == _PRUNED)
            for t in counted(study) if t.state in (_COMPLETE, _PRUNED, optuna.trial.TrialState.FAIL)
            and t.user_attrs.get("plan_key")}


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
        if speedup is None and attrs.get("state") == TrialState.REPEATED:
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
