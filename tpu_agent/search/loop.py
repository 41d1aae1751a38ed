"""The search itself: trials until the study holds --trials measured plans (from any worker), the space has none
left, or --timeout. The proposers' seeds are queued first; this tune's other workers start and stop with it; a
storage that goes away mid-search is waited for (storage.Reconnect), then one line."""

from __future__ import annotations

import socket
import time

import optuna

from tpu_agent.measure.context import Measuring
from tpu_agent.search import workers
from tpu_agent.search.objective import Failed, Objective
from tpu_agent.search.records import TrialRecord
from tpu_agent.search.sampling import Plans, PlanSampler, plan_key, seeds, taken
from tpu_agent.search.space import Space
from tpu_agent.search.storage import Reconnect, lost_storage_errors
from tpu_agent.search.storage import orphan
from tpu_agent.search.study import counted, fail_stale, measured_plans, owner, record_of, recorded

_RUNNING = optuna.trial.TrialState.RUNNING
_WAITING = optuna.trial.TrialState.WAITING


def search(study: optuna.Study, space: Space, measuring: Measuring, on_trial=None, on_note=None,
           seed_offset: int = 0, seeded: bool = True) -> list[TrialRecord]:
    """Up to `measuring.options.trials` measured plans in the study. `seeded`: this tune started the study (it
    queues the seeds, saves the space its other workers read, starts --workers); a joining worker only measures."""
    say = on_note or (lambda line: None)
    runner, options = measuring.runner, measuring.options
    plans = Plans(space, options)
    study.sampler = sampler = PlanSampler(space, plans, options.trials, options.seed + seed_offset)
    say(plans.describe(options.trials))
    if seeded:  # a queued trial runs whatever the count: no more seeds than the budget has room for
        mine = taken(study, space)
        room = options.trials - len(counted(study)) - len(study.get_trials(deepcopy=False, states=(_WAITING,)))
        for picks in seeds(space, plans, options.trials):
            key = plan_key(space, picks, options)
            if room > 0 and key not in mine:
                study.enqueue_trial(picks, user_attrs={"seeded": True})
                mine.add(key)
                room -= 1
        workers.save_space(study, space, options.trials, measuring.baseline_batch,
                           bool(getattr(runner, "fresh_baselines", 0)))
    objective = Objective(space, measuring, measured=measured_plans(study),
                          per_pair=getattr(study.pruner, "per_pair", False), on_trial=on_trial, study=study)
    seen = {t.number for t in recorded(study)}

    def others() -> None:
        """Trials other workers finished, told as this worker's are (the report lists every trial)."""
        for t in recorded(study):
            if t.number not in seen:
                seen.add(t.number)  # this worker's own trials are in `seen` already
                record = record_of(t, earlier=False)
                if record is not None and on_trial is not None:
                    on_trial(record)

    def owned(trial: optuna.Trial):
        trial.set_user_attr("process", owner())  # a tune killed outright: the next open sees its process gone
        trial.set_user_attr("host", socket.gethostname())
        return objective(trial)

    extra = options.workers - 1 if seeded else 0
    where = (runner.script, runner.args, runner.run_dir) if extra > 0 else (None, [], None)
    with workers.Crew(extra, *where, options, study.study_name, say) as crew:  # stopped with this tune (Ctrl-C,
        # SIGTERM, a lost storage), else waited for
        deadline = time.monotonic() + options.timeout if options.timeout else None
        reconnect = Reconnect(study, say)
        while deadline is None or time.monotonic() < deadline:
            try:
                fail_stale(study, own=True)
                trials = study.get_trials(deepcopy=False)
                states = [t.state for t in trials]
                done = len(counted(study))
                running, waiting = states.count(_RUNNING), states.count(_WAITING)
                if done >= options.trials and not waiting:  # a queued trial (a retry, a seed) runs all the same
                    if not any(t.state == _RUNNING and orphan(t) for t in trials):
                        break
                    time.sleep(1.0)  # an orphan is failed once past the grace (fail_stale), not left RUNNING
                    continue
                if not waiting and done + running >= options.trials:
                    others()
                    time.sleep(1.0)  # the last trials run on other workers: one of them may die and be queued again
                    continue
                if not waiting and sampler.untaken(study) == 0:
                    if not running:
                        say(f"the space has no plan left to measure: {done} measured of {options.trials} asked")
                        break
                    time.sleep(1.0)
                    continue
                study.optimize(owned, n_trials=1, catch=(Failed,), gc_after_trial=False)
                seen.update(r.number for r in objective.records)
                others()
            except Exception as exc:  # noqa: BLE001 - a lost server surfaces as whatever Optuna was doing then
                if not isinstance(exc, lost_storage_errors()) and _reachable(study):
                    raise
                reconnect.wait(exc)  # or StorageLost, past RECONNECT_S
            else:
                reconnect.ok()
    if crew.procs:
        others()
    return objective.records


def _reachable(study: optuna.Study) -> bool:
    try:
        study._storage.get_study_id_from_name(study.study_name)
    except lost_storage_errors():
        return False
    return True
