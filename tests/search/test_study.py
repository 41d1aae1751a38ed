"""The Optuna study's bookkeeping, in process on a SQLite file: creation races, resume, stale and interrupted trials."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from tpu_agent.config import TuneOptions
from tpu_agent.errors import InputError
from tpu_agent.search import storage as storage_mod
from tpu_agent.search.study import counted, earlier_records, open_study


def options(tmp_path: Path, **kw) -> TuneOptions:
    return TuneOptions(storage=f"sqlite:///{tmp_path / 'studies.db'}", **kw)


def test_a_study_created_between_the_check_and_the_create_is_shared(tmp_path, monkeypatch):
    """Two tunes at the same instant: both saw no study, one created it first; the other loads it."""
    first = open_study(options(tmp_path), "s", "fp", tmp_path)
    monkeypatch.setattr(optuna.study, "get_all_study_names", lambda storage: [])  # the check came first
    second = open_study(options(tmp_path), "s", "fp", tmp_path)
    assert second.study_name == first.study_name == "s"
    assert second._study_id == first._study_id


def test_resume_of_a_study_that_does_not_exist_is_refused(tmp_path):
    open_study(options(tmp_path), "real", "fp", tmp_path)
    with pytest.raises(InputError, match=r"--resume: there is no study 'typo' in sqlite:.*\(studies there: 'real'\)"):
        open_study(options(tmp_path, study="typo", resume=True), "typo", "fp", tmp_path)


def _trial(study, state: str | None, final):
    t = study.ask()
    t.set_user_attr("plan", {"actions": []})
    if state:
        t.set_user_attr("state", state)
        t.set_user_attr("reason", "")
    if final is not None:
        study.tell(t, final)
    return t


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_interrupted_and_stale_trials_do_not_count_and_earlier_ones_are_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_mod, "GRACE_S", 1)
    monkeypatch.setattr(storage_mod, "HEARTBEAT_S", 1)
    s = open_study(options(tmp_path), "s", "fp", tmp_path)
    _trial(s, "complete", 1.2)  # finished
    _trial(s, None, optuna.trial.TrialState.FAIL)  # Ctrl-C: Optuna failed it, we recorded nothing
    stale = _trial(s, None, None)  # kill -9: left RUNNING
    s._storage.record_heartbeat(stale._trial_id)
    import time

    time.sleep(2.5)  # SQLite keeps whole seconds
    again = open_study(options(tmp_path, resume=True), "s", "fp", tmp_path)
    states = [t.state for t in again.trials]
    assert states[2] == optuna.trial.TrialState.FAIL  # the stale trial is failed, not RUNNING forever
    assert [t.number for t in counted(again)] == [0]  # only the finished trial counts against --trials
    (record,) = earlier_records(again)
    assert record.number == 0 and record.state == "complete" and record.earlier


def test_two_candidates_of_one_single_kind_become_one_choice():
    """Padding every dim and padding only the vocabulary are alternatives (a plan holds one pad_ops): one choice
    with both sets of options, never two choices TPE could combine into an invalid plan."""
    from tpu_agent.propose.base import ProposalRound
    from tpu_agent.propose.candidates import ActionTemplate, Candidate
    from tpu_agent.search.space import build_space

    def cand(id_, template):
        return Candidate(id=id_, title=id_, proposer="offline", preserves_numerics=True, actions=[template])

    round_ = ProposalRound(proposer="offline", requested="offline", candidates=[
        cand("pad-ops", ActionTemplate(kind="pad_ops", choices={"multiple": [8, 128]})),
        cand("fused", ActionTemplate(kind="compile", fixed={"mode": "fused"})),
        cand("pad-ops-dims", ActionTemplate(kind="pad_ops", fixed={"sizes": [50257]}, choices={"multiple": [256]})),
    ])
    space = build_space(round_, 6)
    assert [c.id for c in space.candidates] == ["pad-ops", "fused"]
    assert [o[0].describe() for o in space.options["pad-ops"]] == [
        'pad_ops {"multiple":8}', 'pad_ops {"multiple":128}', 'pad_ops {"multiple":256,"sizes":[50257]}']
