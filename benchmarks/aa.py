"""False passes of the verifier on real processes: a no-op plan verified N times per script, and a real gain.

    .venv/bin/python benchmarks/aa.py                                   # the goal table: 60 A/A + 10 gain runs
    .venv/bin/python benchmarks/aa.py --runs 3 --gain-runs 1 --scripts odd_shapes   # a smoke run
    .venv/bin/python benchmarks/aa.py --busy 2                          # with 2 busy loops beside it

A/A: a plan that changes nothing (matmul precision `default`, which the device already runs) is forced past the
no-op check that `tune` applies (tpu_agent/measure/noop.py) and handed to the verifier itself
(tpu_agent/verify/verdict.verify, the function `tune` verifies with), at the default settings (--processes fresh
process pairs, --pairs pairs, --min-gain): every pass is a false pass. Gain: a plan that makes the script faster
(fused execution by default; --gain-plan) verified the same way; it should pass in at least 9 of 10 runs where its
measured speedup is 1.10x or more.

Each verification runs its own fresh processes in a scratch folder (the Trainer example's checkpoints land there,
not in the repository). `--busy K` starts K processes that spin on the CPU for the whole benchmark (a loaded
machine: what a shared CI runner does to timings). The table gives, per script and load: runs, false passes, the
spread of the A/A point estimates and lower bounds, and the gain plan's passes with its median estimate; the load
average before and after, so a table is read with the machine's state beside it. `--out FILE` keeps every
verdict as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tpu_agent.config import TuneOptions
from tpu_agent.measure.context import Measuring
from tpu_agent.measure.runner import Runner
from tpu_agent.plan.actions import Compile, MatmulPrecision, Plan
from tpu_agent.verify.verdict import verify

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {  # script, its arguments: enough steps for every process pair's warm-up and pairs
    "odd_shapes": ("examples/odd_shapes.py", ["--steps", "60"]),
    "transformer": ("examples/transformer.py", ["--steps", "60"]),
    "hf_trainer": ("examples/hf_trainer.py", ["--steps", "60", "--save-steps", "100000"]),
}
NO_OP = Plan(actions=[MatmulPrecision(precision="default")])
GAINS = {"fused": Plan(actions=[Compile(mode="fused")]), "compiled": Plan(actions=[Compile(mode="compiled")])}


def _spin() -> None:  # a busy loop: one core's worth of load
    while True:
        pass


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def verify_once(script: str, args: list[str], plan: Plan, options: TuneOptions, scratch: Path):
    """One verification in fresh processes, as `tune` runs it (no no-op check: the plan is forced)."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
    cwd = os.getcwd()
    os.chdir(run_dir)  # the script's own files (checkpoints) land here
    try:
        runner = Runner(ROOT / script, args, options, run_dir)
        t0 = time.perf_counter()
        verdict = verify(plan, Measuring(runner, options))
        return verdict, time.perf_counter() - t0
    finally:
        os.chdir(cwd)


def row(name: str, verdicts: list, seconds: list[float]) -> dict:
    speeds = [v.speed for v in verdicts if v.speed is not None]
    failed = [v.reason for v in verdicts if v.speed is None]
    return {
        "script": name, "runs": len(verdicts), "passed": sum(v.accepted for v in verdicts), "failed_runs": failed,
        "speedup_median": statistics.median([s.speedup for s in speeds]) if speeds else None,
        "speedup_min": min((s.speedup for s in speeds), default=None),
        "speedup_max": max((s.speedup for s in speeds), default=None),
        "ci_low_max": max((s.ci_low for s in speeds), default=None),
        "processes": speeds[0].processes if speeds else None, "pairs": speeds[0].pairs if speeds else None,
        "seconds_per_run": statistics.median(seconds) if seconds else None,
        "verdicts": [v.reason for v in verdicts],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", nargs="+", choices=sorted(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--runs", type=int, default=60, help="A/A verifications per script (the goal: 60)")
    parser.add_argument("--gain-runs", type=int, default=10, help="verifications of the gain plan per script")
    parser.add_argument("--gain-plan", choices=sorted(GAINS), default="fused")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the benchmark (a loaded machine)")
    parser.add_argument("--processes", type=int, help="override --processes (default: tune's default)")
    parser.add_argument("--out", type=Path, help="write every verdict here as JSON")
    ns = parser.parse_args(argv)

    settings = {"seed": 0}
    if ns.processes:
        settings["processes"] = ns.processes
    options = TuneOptions(**settings)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(ns.busy)]
    for p in spinners:
        p.start()
    table, before = [], load()
    print(f"A/A: {NO_OP.describe()} forced past the no-op check; gain: {GAINS[ns.gain_plan].describe()}; "
          f"{options.verify_rounds} process pairs x {options.round_pairs} pairs, --min-gain {options.min_gain}; "
          f"busy loops {ns.busy}; load {before}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="tpu-agent-aa-") as tmp:
            for name in ns.scripts:
                script, args = SCRIPTS[name]
                for kind, plan, runs in (("A/A", NO_OP, ns.runs), ("gain", GAINS[ns.gain_plan], ns.gain_runs)):
                    verdicts, seconds = [], []
                    for i in range(runs):
                        verdict, took = verify_once(script, args, plan, options, Path(tmp))
                        verdicts.append(verdict)
                        seconds.append(took)
                        shown = verdict.speed.text() if verdict.speed else verdict.reason[:120]
                        print(f"  {name} {kind} {i + 1}/{runs}: {'PASS' if verdict.accepted else 'fail'} {shown} "
                              f"({took:.0f} s, load {load()})", flush=True)
                    table.append({"kind": kind, **row(name, verdicts, seconds)})
    finally:
        for p in spinners:
            p.terminate()
    after = load()
    print(f"\nload before {before}, after {after}; busy loops {ns.busy}; {sys.argv[0]} {' '.join(argv or sys.argv[1:])}")
    print("| script | kind | runs | passed | speedup median (min-max) | highest CI low | pairs (process pairs) | s/run |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        if r["speedup_median"] is None:
            print(f"| {r['script']} | {r['kind']} | {r['runs']} | {r['passed']} | - | - | - | - |")
            continue
        print(f"| {r['script']} | {r['kind']} | {r['runs']} | {r['passed']} | {r['speedup_median']:.3f} "
              f"({r['speedup_min']:.3f}-{r['speedup_max']:.3f}) | {r['ci_low_max']:.3f} | {r['pairs']} "
              f"({r['processes']}) | {r['seconds_per_run']:.0f} |")
    if ns.out:
        ns.out.write_text(json.dumps({"load_before": before, "load_after": after, "busy": ns.busy,
                                      "options": options.model_dump(mode="json"), "rows": table}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
