#!/usr/bin/env bash
# The PostgreSQL server the search tests start (tests/support/postgres.py): Debian's package, installed when
# its binaries are missing and this is root on a machine with apt-get; otherwise one line, and those tests skip.
set -uo pipefail
say() { echo "setup: $*" >&2; }

if command -v pg_ctl >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
  exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
  say "installing Debian's postgresql (the search tests start a real server)"
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && \
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1; }; then
    exit 0
  fi
fi
say "no PostgreSQL server here and none could be installed: the PostgreSQL tests will skip"
