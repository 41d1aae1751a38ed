"""A trial's heartbeat goes on beating through a database outage (Optuna's own thread ends at its first failed
write, and the trial would then be failed as stale while its worker still measures it)."""

from __future__ import annotations

import time

import optuna
import pytest
import sqlalchemy.exc
from optuna.storages._heartbeat import get_heartbeat_thread

from tpu_agent.search import storage as storage_mod


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_the_heartbeat_thread_survives_failed_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_mod, "HEARTBEAT_S", 1)
    backend = storage_mod.open_storage(f"sqlite:///{tmp_path / 'studies.db'}")
    assert isinstance(backend, storage_mod.BeatingRDBStorage)
    study = optuna.create_study(study_name="s", storage=backend)
    trial = study.ask()
    calls = []
    beat = optuna.storages.RDBStorage.record_heartbeat

    def flaky(self, trial_id):  # the server is down for the first two beats
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise sqlalchemy.exc.OperationalError("UPDATE trial_heartbeats", {}, Exception("server closed the connection"))
        beat(self, trial_id)

    monkeypatch.setattr(optuna.storages.RDBStorage, "record_heartbeat", flaky)
    thread = get_heartbeat_thread(trial._trial_id, backend)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        thread.join()
    assert len(calls) >= 4, calls  # Optuna's thread alone ends at the first failure: one call
    stale = backend._get_stale_trial_ids(study._study_id)
    assert trial._trial_id not in stale


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning", "ignore:Heartbeat of storage")
def test_a_journal_trial_whose_worker_stopped_beating_is_failed_and_queued_again(tmp_path, monkeypatch):
    """Two workers on one journal file (two storages: two hosts sharing a folder). A's trial beats while its
    thread runs; once A is gone (no more beats), B finds it stale past the grace, fails it and queues it once."""
    monkeypatch.setattr(storage_mod, "HEARTBEAT_S", 1)
    monkeypatch.setattr(storage_mod, "GRACE_S", 2)
    url = f"journal:{tmp_path / 'shared' / 'studies.log'}"
    a, b = storage_mod.open_storage(url), storage_mod.open_storage(url)
    assert isinstance(a, storage_mod.BeatingJournalStorage)
    study_a = optuna.create_study(study_name="j", storage=a)
    trial = study_a.ask({"x": optuna.distributions.CategoricalDistribution(["0", "1"])})
    study_b = optuna.load_study(study_name="j", storage=b)

    thread = get_heartbeat_thread(trial._trial_id, a)
    thread.start()
    try:
        time.sleep(3)  # past the grace, beating all along
        assert b._get_stale_trial_ids(study_b._study_id) == []
    finally:
        thread.join()  # worker A is gone
    deadline = time.monotonic() + 20
    while not b._get_stale_trial_ids(study_b._study_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    optuna.storages.fail_stale_trials(study_b)
    trials = study_b.get_trials(deepcopy=False)
    assert trials[0].state == optuna.trial.TrialState.FAIL
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == trials[0].number]
    assert retry.state == optuna.trial.TrialState.WAITING and retry.params == trials[0].params
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):  # A's late result finds it failed
        a.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.COMPLETE, [1.0])
