"""Two workers that chose one plan at the same instant: whatever order the storage puts their writes in, one of
them measures it and the other records a repeat. Each case is one interleaving, played by hand on one study."""
from __future__ import annotations

import threading
import time

import optuna

from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.search.objective import Objective

KEY = "pad_ops=24"


def two_trials():
    study = optuna.create_study()
    objective = Objective(None, Measuring(None, TuneOptions()), measured={}, study=study)
    return objective, study.ask(), study.ask()


def test_the_race_that_measured_a_plan_twice():
    # B writes its key and checks before A has written its own; A then writes its key and checks
    objective, a, b = two_trials()
    b.set_user_attr("plan_key", KEY)
    assert objective._started_elsewhere(b, KEY) is None  # B measures
    a.set_user_attr("plan_key", KEY)
    assert objective._started_elsewhere(a, KEY) == b.number  # A, lower-numbered, still yields: B measures it


def test_a_higher_trial_that_sees_a_lower_one_keyed_yields_to_it():
    objective, a, b = two_trials()
    a.set_user_attr("plan_key", KEY)  # A has written its key, not yet checked
    b.set_user_attr("plan_key", KEY)
    assert objective._started_elsewhere(b, KEY) == a.number
    b.set_user_attr("repeat_of", a.number)
    assert objective._started_elsewhere(a, KEY) is None


def test_a_trial_waits_for_a_claim_to_decide_and_measures_when_it_yields():
    objective, a, b = two_trials()
    a.set_user_attr("plan_key", KEY)
    b.set_user_attr("plan_key", KEY)
    b.set_user_attr("claimed", True)  # B claimed before A checked, and has not decided yet: it will yield to A

    def decide():
        time.sleep(0.3)
        b.set_user_attr("repeat_of", a.number)

    thread = threading.Thread(target=decide)
    thread.start()
    t0 = time.monotonic()
    assert objective._started_elsewhere(a, KEY) is None  # were A to yield to B's claim, neither would measure
    thread.join()
    assert time.monotonic() - t0 >= 0.25
    assert a.study.trials[a.number].user_attrs["measuring"] is True


def test_a_claim_that_never_decides_is_waited_for_a_bounded_time(monkeypatch):
    from tpu_agent.search import objective as objective_mod

    monkeypatch.setattr(objective_mod, "DECIDE_WAIT_S", 0.2)
    objective, a, b = two_trials()
    b.set_user_attr("plan_key", KEY)
    b.set_user_attr("claimed", True)  # its worker was killed between its marks
    a.set_user_attr("plan_key", KEY)
    assert objective._started_elsewhere(a, KEY) is None


def test_a_finished_trial_of_the_plan_is_yielded_to_and_a_killed_one_is_not():
    objective, a, b = two_trials()
    a.set_user_attr("plan_key", KEY)
    a.study.tell(a, state=optuna.trial.TrialState.FAIL)  # killed: none of our state, its retry runs the plan
    b.set_user_attr("plan_key", KEY)
    assert objective._started_elsewhere(b, KEY) is None
    c = b.study.ask()
    b.set_user_attr("state", "measured")
    b.study.tell(b, 1.2)
    c.set_user_attr("plan_key", KEY)
    assert objective._started_elsewhere(c, KEY) == b.number


def test_many_threads_on_one_plan_measure_it_once():
    for _ in range(20):
        study = optuna.create_study()
        objective = Objective(None, Measuring(None, TuneOptions()), measured={}, study=study)
        trials = [study.ask() for _ in range(4)]
        barrier, decisions = threading.Barrier(4), {}

        def run(trial):
            barrier.wait()
            trial.set_user_attr("plan_key", KEY)
            first = objective._started_elsewhere(trial, KEY)
            if first is not None:
                trial.set_user_attr("repeat_of", first)
            decisions[trial.number] = first

        threads = [threading.Thread(target=run, args=(t,)) for t in trials]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(first is None for first in decisions.values()) == 1, decisions
