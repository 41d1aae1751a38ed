"""Where the host's time goes in one compiled step (compiled steps, no script change): cProfile of N steps after
warm-up, and the host thread's CPU time per step without the profiler.

    .venv/bin/python benchmarks/step_profile.py [--model gpt2_deep] [--steps 20] [--warmup 10] [--top 30]
                                                [--sort tottime|cumtime] [--no-profile]

The step is benchmarks/replay.py's (forward, backward, clip_grad_norm_, AdamW step, zero_grad, the loss read
outside the timed Python). Prints versions, date, load and commit with the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings

import torch

from _bench import header
from replay import MODELS, Variant, commit, load


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_deep", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="tottime", choices=["tottime", "cumtime"])
    parser.add_argument("--no-profile", action="store_true", help="only the host CPU time per step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(header(f"benchmarks/step_profile.py: {args.model}, compiled steps, {args.steps} steps after "
                 f"{args.warmup} warm-up steps"))
    print(f"commit {commit()}  load {load()} before", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = Variant("tpu steps", args.model)
        torch.tpu.compile_steps(True)
        for _ in range(args.warmup):
            step()
        step.thread_s.clear()
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        host = statistics.median(step.thread_s) * 1e3
        print(f"host thread CPU per step: median {host:.2f} ms (min {min(step.thread_s) * 1e3:.2f}); "
              f"wall per step (loss read included): median {statistics.median(walls) * 1e3:.2f} ms")
        if not args.no_profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step()
            prof.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            print(f"cProfile over {args.steps} steps: {stats.total_calls} calls "
                  f"({stats.total_calls / args.steps:.0f} a step)")
            stats.sort_stats(args.sort).print_stats(args.top)
            print(out.getvalue())
        torch.tpu.compile_steps(False)
    print(f"load {load()} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
