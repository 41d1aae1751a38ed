"""Several workers filling one study on a real PostgreSQL server (started by the `postgres` fixture) and on a
journal file: each a process of its own (tests/support/fake_worker.py, measuring with a FakeRunner), the tune
that started the study in this process. A SIGKILLed worker loses only its running trial, which Optuna's heartbeat
fails and RetryHeartbeatStaleTrialCallback runs again, once; a server restarted mid-search loses nothing."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest

from support import fake_worker
from support.fake_worker import SlowRunner, quick_heartbeat
from support.paths import REPO
from support.postgres import PASSWORD
from support.tune import wait_for
from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.errors import InputError
from tpu_agent.propose.candidates import ActionTemplate, Candidate
from tpu_agent.search import storage as storage_mod
from tpu_agent.search import workers
from tpu_agent.search.space import Space
from tpu_agent.search.loop import search
from tpu_agent.search.study import counted, open_study, worker_key
from tpu_agent.search.worker import join

MULTIPLES = [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96]


def padding_space() -> Space:
    cand = Candidate(id="pad", title="operand padding", proposer="offline", rank=1, preserves_numerics=True,
                     actions=[ActionTemplate(kind="pad_ops", choices={"multiple": MULTIPLES})])
    return Space(candidates=[cand], options={cand.id: cand.options()})


@pytest.fixture()
def project(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("import torch\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(workers, "WORKER_COMMAND", [sys.executable, str(REPO / "tests/support/fake_worker.py")])
    monkeypatch.setattr(storage_mod, "HEARTBEAT_S", 1)
    monkeypatch.setattr(storage_mod, "GRACE_S", fake_worker.GRACE_S)
    return tmp_path


def lead(project: Path, url: str, name: str, *, trials: int, n: int, said: list | None = None, gate=None):
    """The tune that starts the study: its own worker in this process and n - 1 worker processes (`gate(k)` is
    called as its k-th trial starts)."""
    options = TuneOptions(trials=trials, workers=n, seed=0, storage=url, output_dir=str(project / "runs"))
    script = project / "train.py"
    study = open_study(options, name, "fp", project / "runs", key=worker_key(script, [], options),
                       about={"script": "train.py"})
    runner = SlowRunner(gate=gate)
    runner.script, runner.args, runner.run_dir = script, [], project / "runs" / "lead"
    records = search(study, padding_space(), Measuring(runner, options),
                     on_note=(said.append if said is not None else None))
    return optuna.load_study(study_name=name, storage=storage_mod.open_storage(url)), records


def plans_of(trials) -> list[str]:
    return [t.user_attrs["plan_key"] for t in trials]


def described(trials) -> list[tuple]:
    """Each trial as a failed count shows it: number, state, plan, process, the trial it retries, surplus."""
    return [(t.number, t.state.name, t.params, t.user_attrs.get("process", {}).get("pid"),
             t.system_attrs.get("failed_trial"), t.user_attrs.get("surplus")) for t in trials]


def test_three_workers_fill_one_postgres_study_and_a_killed_one_loses_only_its_running_trial(project, postgres,
                                                                                              monkeypatch):
    url = postgres.create("three")
    hang_file = project / "hung"
    monkeypatch.setenv("FAKE_WORKER_HANG", "worker-2")
    monkeypatch.setenv("FAKE_WORKER_HANG_FILE", str(hang_file))
    killed: list[int] = []

    def kill_when_hung():
        wait_for(hang_file.exists, 120, "worker-2's hung trial")
        pid = int(hang_file.read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_when_hung, daemon=True)
    killer.start()
    said: list[str] = []
    # this tune's second trial waits for worker-2 to hang: the kill lands mid-search, whatever the machine's load
    study, _ = lead(project, url, "s", trials=9, n=3, said=said,
                    gate=lambda k: k == 2 and wait_for(hang_file.exists, 120, "worker-2's hung trial"))
    killer.join(timeout=5)
    assert killed, "worker-2 never hung"
    trials = study.trials
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    lost = [t for t in trials if t.state == optuna.trial.TrialState.FAIL and "state" not in t.user_attrs
            and not t.user_attrs.get("surplus")]  # a trial started at the same instant as the last one: not run
    assert len(lost) == 1 and lost[0].user_attrs["process"]["pid"] == killed[0]  # only its running trial
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == lost[0].number]
    assert len(retries) == 1 and retries[0].state == optuna.trial.TrialState.COMPLETE  # run again, once
    assert retries[0].params == lost[0].params
    measured = counted(study)
    # 10 measured: seen once under 3 busy loops (2026-12-05 04:21 UTC), not explained yet; the trials say how
    assert len(measured) == 9 and len(set(plans_of(measured))) == 9, described(trials)  # 9 measured plans, none twice
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in measured)
    pids = {t.user_attrs["process"]["pid"] for t in measured}
    assert os.getpid() in pids and len(pids) >= 2  # the tune's own worker and the others
    assert all(t.user_attrs["host"] for t in measured)
    assert any("worker-2" in line and "exited -9" in line for line in said), said
    assert any(line.startswith("sampler: TPE over 12 plans") for line in said), said


def test_a_server_restarted_mid_search_loses_nothing(project, postgres, monkeypatch):
    """The server goes down once both workers measured a trial, while the tune's second trial runs: the tune and
    the other worker retry until it is back and finish the search. The tune's second trial waits for the outage,
    so that on a loaded host the tune cannot finish its 8 trials alone before the worker process has started
    (the restart would then never happen). No worker dies here: a grace of 120 s, as a trial running through the
    outage stops beating (Optuna's heartbeat thread ends at its first failed write) and, with 8 s, a slow restart
    on a loaded host would fail it as stale."""
    monkeypatch.setattr(storage_mod, "GRACE_S", 120)
    monkeypatch.setenv(fake_worker.GRACE_VARIABLE, "120")
    url = postgres.create("restart")
    said: list[str] = []
    down = threading.Event()

    def restart():
        wait_for(lambda: said, 120, "the search")  # the study and its tables exist
        check = optuna.load_study(study_name="r", storage=storage_mod.open_storage(url))
        wait_for(lambda: len({t.user_attrs["process"]["pid"] for t in counted(check)}) == 2, 120,
                 "a trial of each worker")
        postgres.stop()
        down.set()
        wait_for(lambda: any("unreachable; retrying" in line for line in said), 120, "the tune to miss the server")
        postgres.start()

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    study, _ = lead(project, url, "r", trials=8, n=2, said=said, gate=lambda k: k == 2 and down.wait(240))
    thread.join(timeout=120)  # the server is back before the next test uses it
    assert down.is_set(), "the server was never stopped"
    assert any("unreachable; retrying" in line for line in said), said
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    measured = counted(study)
    # 8 measured, 7 plans: seen in 1 of 14 runs under 3 busy loops (2026-12-05), not explained yet; the trials say how
    assert len(measured) == 8 and len(set(plans_of(measured))) == 8, described(study.trials)
    assert not [line for line in said if "exited" in line], said  # the other worker rode it out too


def test_a_server_down_for_good_is_one_line_and_resume_goes_on_once_it_is_back(project, postgres, monkeypatch):
    url = postgres.create("down")
    monkeypatch.setattr(storage_mod, "RECONNECT_S", 2)
    stopped = threading.Event()

    def stop_after_one(k: int) -> None:
        if k == 2:
            postgres.stop()
            stopped.set()

    try:
        with pytest.raises(storage_mod.StorageLost, match=r"the study storage postgresql://tpu:\*\*\*@127.0.0.1:\d+/down "
                           r"is unreachable \(.*\); the trials that finished are in it: --resume goes on"):
            lead(project, url, "d", trials=3, n=1, gate=stop_after_one)
    finally:
        if stopped.is_set():
            postgres.start()
    options = TuneOptions(trials=3, seed=0, storage=url, resume=True)
    again = open_study(options, "d", "fp", project / "runs", key=worker_key(project / "train.py", [], options))
    assert len(counted(again)) == 1  # the trial before the outage, kept; the one cut off is queued again
    search(again, padding_space(), Measuring(SlowRunner(), options), seeded=False)
    measured = counted(again)
    assert len(measured) == 3 and len(set(plans_of(measured))) == 3


def test_two_studies_share_one_database(project, postgres):
    url = postgres.create("two")
    a, _ = lead(project, url, "a", trials=2, n=1)
    b, _ = lead(project, url, "b", trials=3, n=1)
    assert sorted(optuna.study.get_all_study_names(url)) == ["a", "b"]
    assert (len(counted(a)), len(counted(b))) == (2, 3)
    assert a.user_attrs["space"] == b.user_attrs["space"] and b.user_attrs["trials"] == 3


def test_two_workers_on_a_journal_in_a_shared_folder(project):
    url = f"journal:{project / 'shared' / 'studies.log'}"
    study, _ = lead(project, url, "j", trials=6, n=2)
    measured = counted(study)
    assert len(measured) == 6 and len(set(plans_of(measured))) == 6
    assert len({t.user_attrs["process"]["pid"] for t in measured}) == 2


def test_bad_storage_and_join_are_one_line_before_any_process(project, postgres):
    url = postgres.create("bad")
    options = TuneOptions(storage=url, join="nope")
    assert PASSWORD not in options.model_dump_json() and "tpu:***@" in options.model_dump_json()  # tune.json's
    script = project / "train.py"
    with pytest.raises(InputError, match=r"--join: there is no study 'nope' in postgresql://tpu:\*\*\*@"):
        join(script, [], options, project / "w", runner=SlowRunner())
    with pytest.raises(InputError, match="password authentication failed") as wrong:
        open_study(TuneOptions(storage=postgres.url("bad", password="not-it")), "s", "fp", project)
    assert "not-it" not in str(wrong.value) and "***" in str(wrong.value)
    with pytest.raises(InputError, match="unknown scheme 'postgresq'"):
        open_study(TuneOptions(storage="postgresq://u:pw@h/db"), "s", "fp", project)
    closed = f"postgresql://tpu:pw@127.0.0.1:{postgres.port + 1}/x"
    with pytest.raises(InputError, match=r"cannot open the study storage postgresql://tpu:\*\*\*@127.0.0.1"):
        open_study(TuneOptions(storage=closed), "s", "fp", project)
    # a study made for another script, or another search space
    lead(project, url, "made", trials=1, n=1)
    (project / "other.py").write_text("import torch\n")
    with pytest.raises(InputError, match="made for script train.py, not other.py"):
        join(project / "other.py", [], options.model_copy(update={"join": "made"}), project / "w")
    with pytest.raises(InputError, match="another search space: --allow \\[\\], here \\['model'\\]"):
        join(script, [], options.model_copy(update={"join": "made", "allow": ["model"]}), project / "w")


def test_the_command_line_refuses_bad_workers_storage_and_join_in_one_line_exit_2(project, postgres):
    from support.processes import one_error_line, run_tool

    cases = {("--workers", "0"): "--workers: Input should be greater than or equal to 1 (got 0)",
             ("--storage", "foo://u:pw@h/db"): "error: --storage foo://u:***@h/db: unknown scheme 'foo'",
             ("--join", "nope", "--storage", postgres.url("postgres", password="wrong-pw")):
                 "password authentication failed"}
    for args, said in cases.items():
        proc = run_tool("tune", "train.py", "--offline", *args, cwd=project)
        assert proc.returncode == 2, proc.stderr
        line = one_error_line(proc)
        assert said in line and "wrong-pw" not in line and not (project / ".tpu-agent" / "runs").exists(), line


def test_verify_on_a_joined_host_verifies_the_study_there_and_records_the_verdicts(project, monkeypatch):
    """`tune --join STUDY --verify-on THIS_HOST` is the tune's pipeline as a worker: its search phase finds the
    study's budget spent, its verification phase verifies the best plan here; tune.json and the study say so."""
    import io
    import json
    import socket

    from rich.console import Console

    from support.fake_runner import FakeRunner
    from tpu_agent import pipeline
    from tpu_agent.measure import runner as runner_mod

    url = f"sqlite:///{project / 'studies.db'}"
    lead(project, url, "v", trials=2, n=1)
    monkeypatch.setattr(runner_mod, "Runner", lambda *a, **k: FakeRunner())  # the worker's search
    monkeypatch.setattr(pipeline, "Runner", lambda *a, **k: FakeRunner())  # its verification
    options = TuneOptions(storage=url, join="v", verify_on=socket.gethostname(), output_dir=str(project / "runs"))
    out = io.StringIO()
    result, files = pipeline.tune(project / "train.py", [], options, console=Console(file=out, width=200),
                                  proposer="offline")
    study = optuna.load_study(study_name="v", storage=url)
    assert study.user_attrs["verified"]["accepted"] and study.user_attrs["verified"]["plan"].startswith("pad_ops")
    assert "accepted" in out.getvalue() and files == {}  # the tune that started the study reports, not a worker
    assert result.best is not None and result.best.accepted and not result.interrupted
    saved = json.loads((Path(result.run_dir) / "tune.json").read_text())
    assert saved["phase"] == "done" and set(saved["phase_s"]) == {"search", "verification", "ablation"}
    assert saved["verdicts"][0]["accepted"] and saved["study"] == "v"


def test_a_joined_worker_follows_the_tunes_later_rounds_and_stops_when_its_search_ends(project):
    """A tune searches round after round, each with a larger budget; a worker that joined between rounds waits
    for the next one (it stopped after the first round's budget before) and stops once the tune says so."""
    url = f"sqlite:///{project / 'runs' / 'studies.db'}"
    options = TuneOptions(trials=2, workers=1, seed=0, storage=url, output_dir=str(project / "runs"))
    script = project / "train.py"
    study = open_study(options, "r", "fp", project / "runs", key=worker_key(script, [], options),
                       about={"script": "train.py"})
    workers.rounds_open(study, True)  # as search_rounds does while its rounds go on

    def theirs() -> list:
        return [t for t in counted(study) if t.user_attrs["process"]["pid"] != os.getpid()]

    def held(k: int) -> None:  # the tune's first trial of round 2 waits until the joined worker measured one
        if k == 3:
            wait_for(lambda: theirs(), 30, "the joined worker's trial in round 2")

    runner = SlowRunner(gate=held)
    runner.script, runner.args, runner.run_dir = script, [], project / "runs" / "lead"
    search(study, padding_space(), Measuring(runner, options))  # round 1: its 2 trials, the tune's own
    (proc, log), = workers.start(1, script, [], options, "r", project / "runs" / "joined", rounds=True)
    try:
        wait_for(lambda: "waiting for the tune's next round" in log.read_text(), 60, "the worker to wait")
        search(study, padding_space(), Measuring(runner, options).with_budget(5))  # round 2
        workers.rounds_open(study, False)  # the tune's search is over
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        workers.stop([(proc, log)])
    measured = counted(study)
    assert len(measured) == 5 and len(set(plans_of(measured))) == 5
    assert theirs() and all(t.number >= 2 for t in theirs())  # round 2's trials, measured there


def test_a_worker_the_tune_started_for_one_round_stops_with_it(project):
    """--workers N starts its workers for each round: they do not wait for the next (the tune waits for them)."""
    url = f"sqlite:///{project / 'runs' / 'studies.db'}"
    options = TuneOptions(trials=2, seed=0, storage=url, output_dir=str(project / "runs"))
    study = open_study(options, "one", "fp", project / "runs", key=worker_key(project / "train.py", [], options),
                       about={"script": "train.py"})
    workers.rounds_open(study, True)
    runner = SlowRunner()
    runner.script, runner.args, runner.run_dir = project / "train.py", [], project / "runs" / "lead"
    search(study, padding_space(), Measuring(runner, options))
    began = time.monotonic()
    records = join(project / "train.py", [], options.model_copy(update={"join": "one"}), project / "w",
                   runner=SlowRunner(), rounds=False)
    assert records == [] and time.monotonic() - began < 10
