"""What profiling costs: steady-state step time under `tpu-agent profile` against a plain run.

    .venv/bin/python benchmarks/profile_overhead.py [--examples mlp odd_shapes] [--steps 30]
                                                    [--warmup 6] [--pairs 4] [--mode fused]

Both sides run the same example for the same number of steps on the bundled
device in the same eager mode: plain (`python examples/X.py --steps S`) and
profiled (`tpu-agent profile examples/X.py --mode M -- --steps S`, the script
left to finish). Step times come from outside both processes, the same way:
the arrival time of each `step=` line the example prints (it syncs with
`loss.item()` every step), so the profiler's own clock is not trusted for its
own overhead. Runs alternate A B / B A; each pair gives a ratio of steady-state
medians (the first --warmup steps left out), and the figure is the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TPU_AGENT = Path(sys.executable).parent / "tpu-agent"


def line_times(command: list[str], env: dict[str, str], cwd: Path) -> list[float]:
    """Seconds between consecutive `step=` lines of the command's stdout."""
    stamps = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=cwd) as proc:
        for raw in proc.stdout:
            if raw.startswith(b"step="):
                stamps.append(time.perf_counter())
        if proc.wait() != 0:
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(command)}")
    return [b - a for a, b in zip(stamps, stamps[1:])]


def steady_median(times: list[float], warmup: int) -> float:
    # times[i] is the step that printed line i + 1; drop the warm-up steps.
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", nargs="+", default=["mlp", "odd_shapes", "cnn", "transformer"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--mode", choices=["eager", "fused"], default="fused")
    args = parser.parse_args()

    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_TPU_DEFER_AND_FUSE", "TPU_AGENT_PROFILE")}
    env["PYTHONUNBUFFERED"] = "1"
    plain_env = dict(env, TORCH_TPU_DEFER_AND_FUSE="1" if args.mode == "fused" else "0")
    print(f"mode {args.mode}, {args.steps} steps per run, first {args.warmup} left out, {args.pairs} pairs (A B / B A)")
    print(f"{'example':<12} {'plain ms':>9} {'profiled ms':>12} {'ratio':>7}  {'pair ratios':<30} {'profiler says ms':>16}")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp) / "runs"
        for name in args.examples:
            script = str(EXAMPLES / f"{name}.py")
            plain_cmd = [sys.executable, script, "--device", "tpu", "--steps", str(args.steps)]
            prof_cmd = [str(TPU_AGENT), "profile", script, "--mode", args.mode, "--warmup", str(args.warmup),
                        "--no-dump-hlo", "-o", str(out_dir), "--", "--steps", str(args.steps)]
            ratios, plains, profs, says = [], [], [], []
            for pair in range(args.pairs):
                order = ("plain", "profiled") if pair % 2 == 0 else ("profiled", "plain")
                result = {}
                for which in order:
                    if which == "plain":
                        result[which] = steady_median(line_times(plain_cmd, plain_env, ROOT), args.warmup)
                    else:
                        before = set(out_dir.glob("*")) if out_dir.exists() else set()
                        result[which] = steady_median(line_times(prof_cmd, env, ROOT), args.warmup)
                        (run_dir,) = set(out_dir.glob("*")) - before
                        stats = json.loads((run_dir / "profile.json").read_text())["steps"]["stats"]
                        says.append(stats["median_s"])
                plains.append(result["plain"])
                profs.append(result["profiled"])
                ratios.append(result["profiled"] / result["plain"])
            ratio = statistics.median(ratios)
            summary.append(ratio)
            print(f"{name:<12} {statistics.median(plains) * 1e3:9.2f} {statistics.median(profs) * 1e3:12.2f} "
                  f"{ratio:7.3f}  {' '.join(f'{r:.3f}' for r in ratios):<30} {statistics.median(says) * 1e3:16.2f}")
    print(f"median ratio over examples: {statistics.median(summary):.3f} (profiled / plain steady-state step time)")


if __name__ == "__main__":
    main()
