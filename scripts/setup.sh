#!/usr/bin/env bash
# Create or reuse the repo's .venv and install tpu-agent into it (editable).
#
#   PYTHON=python3.12 bash scripts/setup.sh   # choose the interpreter (>= 3.11)
#   SETUP_EXTRAS=test,titan bash scripts/setup.sh   # the extras installed (default: test); titan for `-m matrix`
#
# torch is pinned (torch==2.13.0) and installed first, so that nothing later
# resolves a newer torch build. The install is skipped while .venv/.setup-stamp matches a hash of pyproject.toml
# (the torch pin and the extras): re-running is instant.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
TORCH_SPEC="torch==2.13.0"
STAMP="$VENV/.setup-stamp"
# The test extra brings the hf extra (transformers, accelerate: Trainer and Accelerate scripts): what the default
# test pass needs. The titan extra (TorchTitan, which imports triton: a 286 MB download) is for the release matrix,
# `bash scripts/test.sh -m matrix` (docs/ci.md).
EXTRAS="${SETUP_EXTRAS:-test}"
[[ "$EXTRAS" =~ ^[a-z0-9,_-]+$ ]] || { echo "error: SETUP_EXTRAS=$EXTRAS is not a comma-separated list of extras" >&2; exit 1; }

say() { echo "setup: $*" >&2; }
die() { echo "error: $*" >&2; exit 1; }

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON is not an executable on PATH"
    echo "$PYTHON"; return
  fi
  local candidate
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then echo "$candidate"; return; fi
  done
  die "no python3 found; install Python >= 3.11 or set PYTHON"
}

venv_works() { [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import sys" >/dev/null 2>&1; }

make_venv() {
  local py="$1"
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$py is Python $("$py" -c 'import platform; print(platform.python_version())'); tpu-agent needs >= 3.11 (set PYTHON)"
  say "creating $VENV with $("$py" -c 'import sys; print(sys.executable)')"
  if ! "$py" -m venv "$VENV" 2>/dev/null; then
    # Debian/Ubuntu without python3-venv: no ensurepip. Bootstrap pip into the
    # venv with the interpreter's own pip instead.
    say "'$py -m venv' failed (no ensurepip?); bootstrapping pip with '$py -m pip'"
    rm -rf "$VENV"
    "$py" -m venv --without-pip "$VENV"
    "$py" -m pip --python "$VENV/bin/python" install --quiet pip \
      || die "could not install pip into $VENV; install python3-venv (or pip >= 22.3) and retry"
  fi
}

if venv_works; then
  :
else
  [[ -e "$VENV" ]] && { say "$VENV exists but its python does not run; recreating it"; rm -rf "$VENV"; }
  make_venv "$(pick_python)"
fi

PY="$VENV/bin/python"
want=$( { cat pyproject.toml; echo "$TORCH_SPEC"; echo "$EXTRAS"; } | "$PY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/tpu-agent" ]]; then
  say "$VENV is up to date"
  exit 0
fi

if "$PY" - "$TORCH_SPEC" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
req = Requirement(sys.argv[1])
sys.exit(0 if req.specifier.contains(version(req.name), prereleases=True) else 1)
PYEOF
then
  say "$TORCH_SPEC already installed"
else
  say "installing $TORCH_SPEC"
  "$PY" -m pip install "$TORCH_SPEC"
fi

say "installing tpu-agent (editable) with the extras [$EXTRAS]"
"$PY" -m pip install -e ".[$EXTRAS]"
echo "$want" > "$STAMP"
say "done: $VENV/bin/tpu-agent"
