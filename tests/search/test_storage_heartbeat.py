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
