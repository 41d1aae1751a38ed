"""A real PostgreSQL server for the tests: initdb in a temporary folder, started on a free local port (password
auth over TCP) and stopped at the end. The server refuses to run as root, so as root it runs as the `postgres`
user. Found through `pg_config` on PATH or Debian's /usr/lib/postgresql/<version>/bin."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

USER, PASSWORD = "tpu", "s3cret-pw"


def server_bin() -> Path | None:
    """The folder holding initdb and pg_ctl, or None when no server is installed."""
    config = shutil.which("pg_config")
    if config:
        out = subprocess.run([config, "--bindir"], capture_output=True, text=True).stdout.strip()
        if out and (Path(out) / "pg_ctl").exists():
            return Path(out)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """One server: `url(db)` for a database made with `create(db)`; `stop()` and `start()` for a restart."""

    def __init__(self, bindir: Path):
        self.bindir, self.port = bindir, _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="tpu-agent-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # postgres will not run as root
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self.as_user = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups"]
        (self.root / "pw").write_text(PASSWORD)
        if self.as_user:
            os.chown(self.root / "pw", pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth-local=trust", "--auth-host=scram-sha-256",
                  f"--pwfile={self.root / 'pw'}", "-E", "UTF8", "--no-sync")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bindir / tool), *args], capture_output=True, text=True,
                              cwd=self.root, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{tool} failed: {done.stdout[-600:]}{done.stderr[-600:]}")

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=60")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create(self, db: str) -> str:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=PASSWORD, dbname="postgres",
                             autocommit=True) as con:
            con.execute(f'CREATE DATABASE "{db}"')
        return self.url(db)

    def url(self, db: str, password: str = PASSWORD) -> str:
        return f"postgresql://{USER}:{password}@127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        try:
            self.stop()
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def connections_closed() -> Iterator[None]:
    """Every database connection SQLAlchemy opens inside (Optuna's storages, the tool's and the test's) is closed
    when it ends. A storage the test drops still holds its pool's connections, and the garbage collector freed
    them later, under another test of the same worker (psycopg's "deleted while still open" ResourceWarning, in
    the fresh-clone suite as PytestUnraisableExceptionWarning)."""
    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    opened: list = []  # held until closed: none is freed open in between

    def connected(dbapi_connection, _record) -> None:
        opened.append(dbapi_connection)

    event.listen(Pool, "connect", connected)
    try:
        yield
    finally:
        event.remove(Pool, "connect", connected)
        for connection in opened:
            connection.close()  # a no-op on one already closed; a pool that returns it later finds it closed
