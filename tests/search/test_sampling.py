"""No wasted trials: within a study a plan is measured once. A space that fits --trials is measured whole, each
plan once, and the search says it stops short; a larger one is sampled by TPE without repeats; the proposers'
first options are queued first (enqueue_trial). In process, with a FakeRunner."""

from __future__ import annotations

import optuna

from support.fake_runner import FakeRunner
from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.propose.candidates import ActionTemplate, Candidate
from tpu_agent.search.space import Space
from tpu_agent.search.loop import search
from tpu_agent.search.study import counted, open_study


def space(multiples, fused: bool = False) -> Space:
    cands = [Candidate(id="pad", title="operand padding", proposer="offline", rank=1, preserves_numerics=True,
                       actions=[ActionTemplate(kind="pad_ops", choices={"multiple": list(multiples)})])]
    if fused:
        cands.append(Candidate(id="fuse", title="fused execution", proposer="offline", rank=2,
                               preserves_numerics=True, actions=[ActionTemplate(kind="compile",
                                                                                fixed={"mode": "fused"})]))
    return Space(candidates=cands, options={c.id: c.options() for c in cands})


def run(tmp_path, sp: Space, trials: int):
    options = TuneOptions(trials=trials, seed=0, steps=5, storage=f"sqlite:///{tmp_path / 'studies.db'}")
    study = open_study(options, "s", "fp", tmp_path)
    said: list[str] = []
    records = search(study, sp, Measuring(FakeRunner(), options), on_note=said.append)
    return study, records, said


def test_a_space_smaller_than_the_trials_is_measured_whole_each_plan_once_and_said(tmp_path):
    study, records, said = run(tmp_path, space([8, 16], fused=True), trials=20)  # 3 x 2 - 1 = 5 plans
    assert said[0] == "sampler: every plan once (the space has 5 plans, 20 trials asked: 5 trials)"
    assert said[-1] == "the space has no plan left to measure: 5 measured of 20 asked"
    assert [r.state for r in records] == ["complete"] * 5
    assert len({r.plan.key() for r in records}) == 5 and len(counted(study)) == 5


def test_tpe_on_a_larger_space_never_proposes_a_measured_plan_and_seeds_come_first(tmp_path):
    study, records, said = run(tmp_path, space(range(8, 8 * 31, 8), fused=True), trials=6)  # 61 plans
    assert said == ["sampler: TPE over 61 plans, a plan already measured never proposed again"]
    assert len(records) == 6 and all(r.state == "complete" for r in records)  # no repeat, none wasted
    assert len({r.plan.key() for r in records}) == 6
    # the proposers' own: both first options together, then each alone, queued before TPE's
    seeded = [t for t in study.trials if t.user_attrs.get("seeded")]
    assert [t.number for t in seeded] == [0, 1, 2]
    assert [t.params for t in seeded] == [{"pad": "0", "fuse": "0"}, {"pad": "0", "fuse": "off"},
                                          {"pad": "off", "fuse": "0"}]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in seeded)


def test_the_tune_says_how_it_samples_and_that_the_space_ran_out(tmp_path, monkeypatch):
    from support.fake_tune import TwoGroups, tune

    (tmp_path / "train.py").write_text("import torch\n")
    result, _, said = tune(tmp_path, monkeypatch, TwoGroups(), trials=20)
    assert "sampler: every plan once (the space has 7 plans, 20 trials asked: 7 trials)" in said
    assert "the space has no plan left to measure: 7 measured of 20 asked" in said
    assert len({t.plan.key() for t in result.trials}) == len(result.trials) == 7
