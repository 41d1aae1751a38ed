"""A real PostgreSQL server for the storage tests, started once per test process and stopped at its end."""

from __future__ import annotations

import pytest

from support.postgres import Postgres, server_bin


@pytest.fixture(scope="session")
def postgres():
    bindir = server_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server installed (Debian: apt-get install postgresql)")
    server = Postgres(bindir)
    try:
        yield server
    finally:
        server.close()
