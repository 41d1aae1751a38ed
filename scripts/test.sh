#!/usr/bin/env bash
# Set up (the venv; a PostgreSQL server's binaries for the search tests), then run the test suite on two workers (pytest-xdist; the suite is sized for a 2-core machine).
# Tests are dealt longest first (tests/durations.json; `--store-durations` updates it) into one share per
# worker; an idle worker steals the other's short tail (`--dist worksteal`), so both finish together. Extra arguments go to pytest (`-n 0` runs it in one process,
# `-m "not slow"` is the quick pass; `SETUP_EXTRAS=test,titan bash scripts/test.sh -m matrix` the release matrix, docs/ci.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
bash scripts/postgres.sh
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal tests "$@"
