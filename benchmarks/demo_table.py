"""Several runs of the same tune side by side: the plan each kept, its verified interval, and whether the intervals
agree. For the README's demo, run in fresh clones (scripts/demo.sh each time), so that a reader sees how much
one run's figures move, not one run's output as if it were fixed.

    .venv/bin/python benchmarks/demo_table.py clone1/.tpu-agent/runs/*/report.json clone2/... clone3/...

Prints a markdown table, one column per run (host, the kept plan, its speedup and 95 % interval with its pairs and
process pairs, what the ablation left out), and one line: whether every two kept intervals overlap, and where
the runs kept different plans.
"""

from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path


def column(report: dict) -> dict[str, str]:
    best = report.get("best")
    speed = (best or {}).get("speed") or {}
    plan = " + ".join(_action(a) for a in (best or {}).get("plan", {}).get("actions", [])) or "no change kept"
    interval = (f"{speed['speedup']:.3f}x (CI {speed['ci_low']:.3f}-{speed['ci_high']:.3f}, {speed['pairs']} pairs "
                f"in {speed.get('processes', 1)} process pairs)") if speed else "-"
    return {"host": report.get("host") or "-", "kept": plan, "verified": interval,
            "left out": "; ".join((best or {}).get("left_out", [])) or "-",
            "_ci": (speed["ci_low"], speed["ci_high"]) if speed else None, "_plan": plan}


def _action(action: dict) -> str:
    fields = {k: v for k, v in action.items() if k not in ("kind", "effect", "schema_version")}
    return f"{action.get('kind')} {json.dumps(fields, separators=(',', ':'))}"


def table(paths: list[Path]) -> str:
    cols = [column(json.loads(p.read_text())) for p in paths]
    lines = ["| | " + " | ".join(f"run {i + 1}" for i in range(len(cols))) + " |",
             "|---|" + "---|" * len(cols)]
    for key in ("host", "kept", "verified", "left out"):
        lines.append(f"| {key} | " + " | ".join(c[key].replace("|", "/") for c in cols) + " |")
    plans = {c["_plan"] for c in cols}
    cis = [c["_ci"] for c in cols if c["_ci"]]
    overlap = all(a[0] <= b[1] and b[0] <= a[1] for a, b in combinations(cis, 2))
    said = ("the runs kept the same plan" if len(plans) == 1 else f"the runs kept {len(plans)} different plans")
    said += "; every two verified intervals overlap" if overlap else "; some verified intervals do not overlap"
    return "\n".join(lines) + "\n\n" + said + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: demo_table.py REPORT.json [REPORT.json ...]")
    sys.stdout.write(table([Path(p) for p in sys.argv[1:]]))
