#!/usr/bin/env bash
# The demo: set up, check the environment, then run the main job.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
TPU_AGENT=.venv/bin/tpu-agent

# The main job. When `tpu-agent tune` exists this line becomes:
#   MAIN_JOB=(tune examples/odd_shapes.py --trials 20)
MAIN_JOB=(run examples/odd_shapes.py -- --device cpu --steps 5)

echo "== tpu-agent doctor"
"$TPU_AGENT" doctor
echo

if [[ "${MAIN_JOB[0]}" != tune ]]; then
  cat <<'NOTE'
NOTE: `tpu-agent tune` is not implemented yet, nor are the profiler and the
agent. The best that exists today is `tpu-agent run`, shown below with
`--device cpu` (the bundled `tpu` device is still being built): it runs the
script exactly as `python` would and records the run under .tpu-agent/runs/.

NOTE
fi

echo "== tpu-agent ${MAIN_JOB[*]}"
"$TPU_AGENT" "${MAIN_JOB[@]}"
