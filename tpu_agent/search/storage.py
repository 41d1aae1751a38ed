"""Where a study lives: SQLite under .tpu-agent/ for one host (the default), PostgreSQL (or any SQLAlchemy RDB URL)
for workers on many hosts, or an Optuna journal file (`journal:PATH`) in a folder the hosts share. Optuna's own
storages: RDB ones beat a heartbeat for each running trial, and a trial whose worker died is failed and run again
once (RetryHeartbeatStaleTrialCallback, Optuna 5's name for RetryFailedTrialCallback). A password in a URL is shown as *** everywhere we print or record it."""

from __future__ import annotations

import datetime
import fcntl
import re
import shlex
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import optuna
from optuna.storages._heartbeat import BaseHeartbeat

from tpu_agent.config import redact_url
from tpu_agent.errors import InputError, TpuAgentError
from tpu_agent.paths import database_refusal

STUDY_DB = "studies.db"
JOURNAL = "journal:"
RDB_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")
HEARTBEAT_S = 30  # a RUNNING trial whose process stopped beating this long ago (kill -9) is failed as stale
GRACE_S = 90
SQLITE_TIMEOUT_S = 60  # several tunes sharing one SQLite file wait their turn to write, not fail
CONNECT_TIMEOUT_S = 10  # an unreachable database server: one line after this long, not a TCP default of minutes
RECONNECT_S = 120  # a database gone mid-search: its workers retry this long (1, 2, 4 ... s apart), then stop


def retry_once() -> optuna.storages.RetryHeartbeatStaleTrialCallback:
    """A trial whose worker died (its heartbeat stopped, or its process is gone) is queued once more."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)


def storage_url(options, runs_root: Path) -> str:
    return options.storage or f"sqlite:///{(runs_root.parent / STUDY_DB).resolve()}"


def password_of(url: str) -> str | None:
    found = re.search(r"//[^:/@]+:([^@]+)@", url)
    return found.group(1) if found else None


def redact(url: str) -> str:
    return redact_url(url)


def dashboard_command(url: str) -> str:
    """The one command that opens the study's storage in optuna-dashboard (`pip install 'tpu-agent[dashboard]'`);
    a password in the URL is shown as ***."""
    shown = url[len(JOURNAL):] if url.startswith(JOURNAL) else redact(url)
    return f"optuna-dashboard {shlex.quote(shown)}"


def scheme_of(url: str) -> str:
    if url.startswith(JOURNAL):
        return "journal"
    return url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else ""


def check_url(url: str) -> None:
    """A URL we cannot open at all: one line, before anything connects."""
    scheme = scheme_of(url)
    if scheme == "journal":
        if not url[len(JOURNAL):]:
            raise InputError("--storage journal:PATH needs the journal file's path (journal:/shared/studies.log)")
        return
    if scheme not in RDB_SCHEMES:
        said = f"unknown scheme {scheme!r}" if scheme else "not a storage URL"
        raise InputError(f"--storage {redact(url)}: {said} (sqlite:///FILE, postgresql://USER@HOST/DB, "
                         "mysql://USER@HOST/DB, or journal:FILE for a shared folder)")


def open_storage(url: str):
    """Optuna's storage for `url`: an RDB one with a heartbeat, or a journal file. A SQLite file's tables are
    created under a file lock: tunes started together in a fresh folder would otherwise race on creating them
    (`table version_info already exists`)."""
    check_url(url)
    retry = retry_once()
    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len(JOURNAL):]).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return BeatingJournalStorage(JournalFileBackend(str(path)), retry)
    sqlite = url.startswith("sqlite:///") and url != "sqlite:///:memory:"
    if sqlite:
        engine = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    elif scheme_of(url) in ("postgresql", "postgres"):
        engine = {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}, "pool_pre_ping": True}
    else:
        engine = {"pool_pre_ping": True}
    import sqlalchemy.exc

    for attempt in range(3):
        with warnings.catch_warnings(), _file_lock(Path(url[len("sqlite:///"):] + ".lock") if sqlite else None):
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            try:
                return BeatingRDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                         heartbeat_stale_trial_callback=retry, engine_kwargs=engine)
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
                if attempt == 2:  # workers on several hosts creating a fresh database's tables at once: one wins
                    raise
                time.sleep(0.5 + attempt)


class BeatingRDBStorage(optuna.storages.RDBStorage):
    """Optuna's RDB storage, whose heartbeat outlives a database outage. Optuna's heartbeat thread ends at its first
    failed write, so a trial measured through a server restart stopped beating and was failed as stale (and run
    again) once the grace had passed, though its worker was alive and finished it."""

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            super().record_heartbeat(trial_id)
        except lost_storage_errors():
            pass  # the next beat, HEARTBEAT_S later, writes again once the server is back


class BeatingJournalStorage(optuna.storages.JournalStorage, BaseHeartbeat):
    """Optuna's journal storage with the RDB storage's heartbeat, which Optuna gives the journal none of: a worker
    on another host sharing the journal's folder that is killed leaves its trial RUNNING, its plan measured by
    nobody, until a live worker sees the trial's last beat (a system attribute, wall-clock seconds) older than
    the grace, fails it and queues it once more. On one host a dead worker's process says so sooner
    (study.fail_stale)."""

    BEAT = "heartbeat"

    def __init__(self, backend, stale_callback) -> None:
        super().__init__(backend)
        self._stale_callback = stale_callback

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            self.set_trial_system_attr(trial_id, self.BEAT, time.time())
        except (optuna.exceptions.UpdateFinishedTrialError, OSError):
            pass  # finished meanwhile, or the shared folder hiccuped: the next beat writes again

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now, wall = time.time(), datetime.datetime.now()
        stale = []
        for t in self.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            beat = t.system_attrs.get(self.BEAT)
            age = now - beat if isinstance(beat, (int, float)) else (
                (wall - t.datetime_start).total_seconds() if t.datetime_start is not None else 0.0)
            if age > GRACE_S:
                stale.append(t._trial_id)
        return stale

    def get_heartbeat_interval(self) -> int:
        return HEARTBEAT_S

    def get_heartbeat_stale_trial_callback(self):
        return self._stale_callback


def first_line(exc: BaseException, url: str) -> str:
    """An exception as one line, the URL's password (should a driver echo it) as ***."""
    text = (str(exc).splitlines() or [""])[0][:200]
    secret = password_of(url)
    refused = database_refusal(url[len("sqlite:///"):], exc) if url.startswith("sqlite:///") else None
    return f"{type(exc).__name__}: {text.replace(secret, '***') if secret else text}" + (f"; {refused}" if refused else "")


def lost_storage_errors() -> tuple[type[BaseException], ...]:
    """What a storage raises when its server goes away mid-search (not a bug of ours): retried, then one line."""
    import sqlalchemy.exc

    return (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, optuna.exceptions.StorageInternalError)


def _root(exc: BaseException) -> BaseException:
    """The driver's own error under Optuna's wrappers ("An exception is raised during the commit")."""
    seen = exc
    while seen.__cause__ is not None or seen.__context__ is not None:
        seen = seen.__cause__ or seen.__context__
        if isinstance(seen, lost_storage_errors()[:2]):
            return seen
    return exc


class StorageLost(TpuAgentError):
    """The study's database stayed unreachable past RECONNECT_S mid-search (exit 1; what finished is kept)."""


class Reconnect:
    """A search's storage gone away: waits 1, 2, 4 ... 16 s between attempts, for up to RECONNECT_S, said once;
    then StorageLost."""

    def __init__(self, study: optuna.Study, say) -> None:
        backend = getattr(study._storage, "_backend", study._storage)  # Optuna caches an RDB storage in a wrapper
        engine_url = getattr(getattr(backend, "engine", None), "url", None)
        self.shown = engine_url.render_as_string(hide_password=True) if engine_url is not None else ""
        self.secret = engine_url.password if engine_url is not None else None
        self.say, self.since, self.attempt = say, None, 0
        sqlite = engine_url is not None and engine_url.drivername.startswith("sqlite")
        self.sqlite = engine_url.database if sqlite else None  # a file: a refusal there has a cause to say

    def wait(self, exc: BaseException) -> None:
        where = f"the study storage {self.shown}".rstrip()
        refused = database_refusal(self.sqlite, _root(exc)) if self.sqlite else None
        if refused is not None:  # a SQLite file on a full disk is not unreachable: no retrying, its cause said
            raise StorageLost(f"cannot write {where}: {refused}; the trials that finished are in it: --resume goes "
                              "on once it takes writes again") from None
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since > RECONNECT_S:
            text = first_line(_root(exc), "")
            raise StorageLost(f"{where} is unreachable ({text.replace(self.secret, '***') if self.secret else text});"
                              " the trials that finished are in it: --resume goes on once it is back") from None
        if self.attempt == 0:
            self.say(f"{where} is unreachable; retrying for up to {int(RECONNECT_S)} s")
        time.sleep(min(2 ** self.attempt, 16))
        self.attempt += 1

    def ok(self) -> None:
        self.since, self.attempt = None, 0


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


def orphan(t: optuna.trial.FrozenTrial, after_s: float = 0.0) -> bool:
    """A RUNNING trial no worker ever wrote to (no process, no picks), started `after_s` ago or more: its worker
    lost the storage between creating it and its first write, and no heartbeat of it was ever recorded."""
    if "process" in t.user_attrs or t.params or t.datetime_start is None:
        return False
    return (datetime.datetime.now() - t.datetime_start).total_seconds() >= after_s
