#!/usr/bin/env bash
# The demo: set up, check the environment, then run the main job: tune a bundled
# example offline (no API key), which writes report.md, patch.diff and plan.json
# under .tpu-agent/runs/. On a 2-core CPU it takes several minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
TPU_AGENT=.venv/bin/tpu-agent

# The example runs 20 steps by default; each measured process needs 2 warm-up + 20 (--steps), so it gets 60
# and no baseline process runs out of steps mid-trial.
MAIN_JOB=(tune examples/odd_shapes.py --trials 20 --offline -- --steps 60)

echo "== tpu-agent doctor"
"$TPU_AGENT" doctor
echo
echo "== tpu-agent ${MAIN_JOB[*]}"
"$TPU_AGENT" "${MAIN_JOB[@]}"
