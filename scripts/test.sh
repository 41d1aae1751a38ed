#!/usr/bin/env bash
# Set up, then run the test suite on two workers (pytest-xdist; the suite is sized for a
# 2-core machine). Extra arguments go to pytest (`-n 0` runs it in one process).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 tests "$@"
