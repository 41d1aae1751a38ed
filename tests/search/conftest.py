"""A real PostgreSQL server for the storage tests, started once per test process and stopped at its end."""

from __future__ import annotations

import pytest

from support.postgres import Postgres, connections_closed, server_bin


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


@pytest.fixture(autouse=True)
def postgres_connections_closed(request):
    """A test on the server closes the connections it opened (storages it dropped included) when it ends."""
    if "postgres" not in request.fixturenames:
        yield
        return
    with connections_closed():
        yield
