"""Where a tune's wall time goes: the baseline profile, the search, verification, ablation and the final profile.

    .venv/bin/python benchmarks/tune_phases.py [--keep DIR] tests/data/scripts/nanogpt_dict.py -- --allow model --trials 4 --verify 1
    .venv/bin/python benchmarks/tune_phases.py examples/varlen_lm.py -- --trials 4

Runs `tpu-agent tune` on a copy of the script in a fresh directory (a fresh study, no earlier compiles in its
own run directory; XLA's persistent cache is the machine's, as for a user) and prints tune.json's `phase_s`
(seconds per phase, measured by the tune itself) with the machine's load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import header

from tpu_agent.plan.actions import Plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--keep", type=Path, help="copy the tune's run directory (report.md, tune.json) here")
    parser.add_argument("tune_args", nargs=argparse.REMAINDER, help="after --: options for tpu-agent tune")
    args = parser.parse_args()
    extra = args.tune_args[1:] if args.tune_args[:1] == ["--"] else args.tune_args
    tool = Path(sys.executable).with_name("tpu-agent")
    print(header(f"tpu-agent tune {Path(args.script).name} {' '.join(extra)}: wall time by phase"))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / Path(args.script).name
        shutil.copy(args.script, script)
        t0 = time.perf_counter()
        proc = subprocess.run([str(tool), "tune", script.name, *extra], cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"tune failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        (run_dir,) = (Path(tmp) / ".tpu-agent" / "runs").iterdir()
        tune = json.loads((run_dir / "tune.json").read_text())
        if args.keep is not None:
            shutil.copytree(run_dir, args.keep / run_dir.name, ignore=shutil.ignore_patterns("workspaces", "hlo"))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    total = sum(tune["phase_s"].values())
    for phase, seconds in tune["phase_s"].items():
        print(f"  {phase:13s} {seconds:7.1f} s  {seconds / total:6.1%}")
    print(f"  {'tune':13s} {tune['duration_s']:7.1f} s  (process wall {wall:.1f} s, {len(tune['trials'])} trials, "
          f"{len(tune['verdicts'])} verifications)")
    best = tune.get("best")
    print("verified: " + (f"{Plan.model_validate(best['plan']).describe()}: {best['reason']}" if best else "nothing"))


if __name__ == "__main__":
    main()
