"""Search at scale on one machine: measured plans per hour with 1, 2 and 4 workers filling one study, and how
often a plan that changes nothing (an A/A trial) looks like a gain when workers share the cores.

    .venv/bin/python benchmarks/workers.py                            # odd_shapes, 1 2 4 workers, 14 trials each
    .venv/bin/python benchmarks/workers.py --workers 1 2 --trials 6 --script examples/mlp.py -- --steps 200

Every trial is an A/A trial: operand padding of dims of one size the script has none of (pad_ops sizes=[100003 +
i]), so the plan runs the very program the baseline runs, yet each is a distinct plan (the search never proposes a
plan twice). Each worker count gets a fresh study (SQLite in a temporary folder; this host's workers share it) and
the real search: the tune's own worker in this process and N - 1 worker processes (`python -m
tpu_agent.search.worker`), each measuring against its own warm baseline process (A B A B pairs).

Per worker count: wall time from the search's start (workers' start-up and warm-up included) to its last trial,
measured plans, plans per hour, the machine's 1-minute load (os.getloadavg) before and after, and the A/A trials
whose search interval (95 % bootstrap CI of the pair ratios) clears 1 + --min-gain (a false accept, had the search
interval decided; verification decides in tune, in fresh processes) or merely excludes 1.0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import header  # noqa: E402

from tpu_agent.config import TuneOptions  # noqa: E402
from tpu_agent.measure.context import Measuring  # noqa: E402
from tpu_agent.measure.runner import Runner  # noqa: E402
from tpu_agent.plan.actions import PadOps  # noqa: E402
from tpu_agent.propose.candidates import ActionTemplate, Candidate  # noqa: E402
from tpu_agent.search.space import Space  # noqa: E402
from tpu_agent.search.loop import search  # noqa: E402
from tpu_agent.search.study import counted, open_study, worker_key  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def aa_space(n: int) -> Space:
    """n plans that change nothing: padding only dims of a size the script does not have."""
    cand = Candidate(id="aa", title="A/A: pad dims of an absent size", proposer="offline", rank=1,
                     preserves_numerics=True, actions=[ActionTemplate(kind="pad_ops", fixed={"multiple": 8})])
    return Space(candidates=[cand], options={"aa": [(PadOps(multiple=8, sizes=(100003 + i,)),) for i in range(n)]})


def one(workers: int, script: Path, args: list[str], trials: int, steps: int, folder: Path) -> dict:
    options = TuneOptions(trials=trials, workers=workers, steps=steps, seed=workers, verify=0,
                          storage=f"sqlite:///{folder / 'studies.db'}", output_dir=str(folder / "runs"))
    name = f"aa-{workers}"
    study = open_study(options, name, name, folder / "runs", key=worker_key(script, args, options))
    run_dir = folder / "runs" / name
    run_dir.mkdir(parents=True)
    runner = Runner(script, args, options, run_dir)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        search(study, aa_space(4 * trials), Measuring(runner, options), on_note=lambda line: print("   ", line))
    finally:
        runner.close()
    wall = time.perf_counter() - t0
    measured = counted(study)
    lows = [t.user_attrs.get("speedup_ci95", [None])[0] for t in measured if t.user_attrs.get("state") == "complete"]
    ratios = sorted(t.user_attrs.get("speedup") for t in measured if t.user_attrs.get("speedup"))
    return {"workers": workers, "wall_s": wall, "plans": len(measured), "per_hour": len(measured) / wall * 3600,
            "load": (load_before, os.getloadavg()[0]), "complete": len(lows),
            "false_accepts": sum(1 for low in lows if low is not None and low > 1 + options.min_gain),
            "excludes_1": sum(1 for low in lows if low is not None and low > 1.0),
            "ratios": (ratios[0], ratios[len(ratios) // 2], ratios[-1]) if ratios else None,
            "hosts": sorted({(t.user_attrs.get("process") or {}).get("pid") for t in measured})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--trials", type=int, default=14, help="measured plans per worker count")
    parser.add_argument("--steps", type=int, default=20, help="pairs per trial (tune's default)")
    parser.add_argument("--script", default=str(REPO / "examples" / "odd_shapes.py"))
    parser.add_argument("script_args", nargs="*", default=["--steps", "200"])
    ns = parser.parse_args()
    print(header(f"search workers: {ns.script} {' '.join(ns.script_args)}, {ns.trials} A/A trials per worker "
                 f"count, --steps {ns.steps}"))
    rows = []
    for n in ns.workers:
        with tempfile.TemporaryDirectory(prefix="tpu-agent-workers-") as tmp:
            print(f"  {n} worker(s) ...", flush=True)
            row = one(n, Path(ns.script).resolve(), ns.script_args, ns.trials, ns.steps, Path(tmp))
            rows.append(row)
            lo, mid, hi = row["ratios"] or (0, 0, 0)
            print(f"  {n} worker(s): {row['plans']} plans in {row['wall_s']:.0f} s = {row['per_hour']:.0f} plans/h, "
                  f"load {row['load'][0]:.1f} -> {row['load'][1]:.1f}; A/A ratios {lo:.3f} / {mid:.3f} / {hi:.3f} "
                  f"(min / median / max); CI low > 1 + min-gain: {row['false_accepts']} of {row['complete']}, "
                  f"> 1.0: {row['excludes_1']}; {len(row['hosts'])} worker processes", flush=True)
    total = sum(r["complete"] for r in rows)
    print(f"A/A: {sum(r['false_accepts'] for r in rows)} false accepts (CI low > 1 + min-gain) in {total} A/A "
          f"trials; {sum(r['excludes_1'] for r in rows)} with CI low > 1.0")


if __name__ == "__main__":
    main()
