"""The search's record in the study, in process with step times from a table: failed numerics and memory limits
as Optuna constraints, the attributes a study is read by outside our report, and what each pruner stops."""

from __future__ import annotations

import optuna
import pytest

from support.search_table import COMPILES, FAST, OOM, ROUNDS, SLOW, SOMEWHAT, run, space
from tpu_agent.config import TuneOptions
from tpu_agent.search.objective import NUMERICS, OUT_OF_MEMORY
from tpu_agent.search.study import feasible, open_study, ranked_plans


def test_failed_numerics_and_out_of_memory_are_infeasible_trials_with_their_attributes(tmp_path):
    study, records, _ = run(tmp_path, space(FAST, ROUNDS, OOM), [FAST, ROUNDS, OOM, ROUNDS, OOM])
    trials = study.trials
    assert [r.state for r in records] == ["complete", "numerics", "failed", "repeated", "repeated"]
    # every one recorded as COMPLETE: TPE learns from it (a FAIL would be ignored); the constraint says infeasible
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 5
    fast, rounds, oom, rounds_again, oom_again = trials
    assert fast.constraints[NUMERICS] <= 0 and feasible(fast) and fast.user_attrs["feasible"] is True
    assert rounds.constraints[NUMERICS] == pytest.approx(0.10 - 0.02, rel=1e-3)  # 10 % worse, 2 % allowed
    assert not feasible(rounds) and rounds.value == 0.0 and rounds.user_attrs["speedup"] == pytest.approx(1 / 0.7, rel=0.05)
    assert oom.constraints == {OUT_OF_MEMORY: 1.0} and oom.user_attrs["reason"].startswith("out_of_memory")
    assert rounds_again.constraints == rounds.constraints and oom_again.constraints == oom.constraints
    assert rounds_again.intermediate_values == rounds.intermediate_values  # its pairs, for the pruners
    # the attributes a study is read by in optuna-dashboard
    attrs = fast.user_attrs
    assert attrs["description"] == records[0].plan.describe() and "fused" in attrs["description"]
    assert attrs["state"] == "complete" and attrs["pairs"] == 8
    low, high = attrs["speedup_ci95"]
    assert low <= attrs["speedup"] <= high and attrs["speedup"] == pytest.approx(1.25, rel=0.05)
    assert "within" in attrs["numerics"] or "no worse" in attrs["numerics"]
    assert study.user_attrs["script"] == "train.py" and study.user_attrs["pruner"] == "median"
    # only the feasible plan is ever verified, though the failed-numerics one measured faster
    assert [p.describe() for p in ranked_plans(study)] == [records[0].plan.describe()]
    assert study.best_trial.number == 0


def test_the_median_pruner_stops_a_slow_trial_once_four_trials_finished_and_its_repeat_is_not_run(tmp_path):
    study, records, runner = run(tmp_path, space(FAST, SOMEWHAT, SLOW), [FAST, SOMEWHAT, FAST, SOMEWHAT, SLOW, SLOW])
    assert [r.state for r in records][-2:] == ["pruned", "pruned"]
    slow, again = study.trials[-2:]
    assert slow.state == optuna.trial.TrialState.PRUNED and max(slow.intermediate_values) == 3  # after 4 pairs
    assert all(v < 1.0 for v in slow.intermediate_values.values())  # running medians of 1.3x slower pairs
    assert again.state == optuna.trial.TrialState.PRUNED and again.intermediate_values == slow.intermediate_values
    assert records[-1].reason == "same plan as trial 4, pruned: not run again" and runner.measured.count(SLOW) == 1


@pytest.mark.parametrize("pruner,somewhat", [("wilcoxon", "complete"), ("wilcoxon-best", "pruned")])
def test_wilcoxon_reads_each_pair_and_stops_what_is_worse_than_the_best(tmp_path, pruner, somewhat):
    study, records, _ = run(tmp_path, space(FAST, SOMEWHAT, SLOW), [FAST, SLOW, SOMEWHAT], pruner=pruner)
    fast, slow, some = study.trials
    assert len(set(fast.intermediate_values.values())) == 8  # each pair's own ratio, not a running value
    assert records[1].state == "pruned" and slow.state == optuna.trial.TrialState.PRUNED
    # 1.09x: faster than the baseline, slower than the best; only the unguarded policy stops it
    assert records[2].state == somewhat


def test_a_resumed_study_keeps_the_pruner_it_was_made_with(tmp_path):
    options = TuneOptions(storage=f"sqlite:///{tmp_path / 'studies.db'}")
    open_study(options, "s", "fp", tmp_path, pruner="wilcoxon")
    again = open_study(options.model_copy(update={"resume": True}), "s", "fp", tmp_path)
    assert again.pruner.name == "wilcoxon" and again.pruner.per_pair


@pytest.mark.parametrize("pruner", ["median", "wilcoxon"])
def test_pairs_in_which_a_process_compiled_are_not_judged_nor_counted(tmp_path, pruner):
    """A fused plan compiling through its first pairs is slow there and 1.25x after: a pruner reading those pairs
    would stop the best plan (benchmarks/pruners.py saw it: 0.18x after 4 pairs, 1.34x in full)."""
    order = [FAST, SOMEWHAT, FAST, SOMEWHAT, COMPILES]
    study, records, _ = run(tmp_path, space(FAST, SOMEWHAT, COMPILES), order, pruner=pruner)
    compiles = study.trials[-1]
    assert records[-1].state == "complete" and compiles.state == optuna.trial.TrialState.COMPLETE
    assert len(compiles.intermediate_values) == 8 - 5  # only the pairs without compilation were reported
    assert compiles.user_attrs["compiling_pairs"] == 5 and compiles.user_attrs["pairs"] == 3
    assert compiles.value == pytest.approx(1.25, rel=0.05)  # the steady state's speedup, not the compiles'
