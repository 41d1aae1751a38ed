"""Per-op cost of the bundled tpu device, as ratios from one run.

    .venv/bin/python benchmarks/dispatch.py [--rounds 7] [--ops 2000]

One op, `x + y` on two 64x64 float32 tensors, timed per op:
- `torch cpu`: PyTorch's own CPU kernel (for scale);
- `jax jit`: the same add as a `jax.jit` call on JAX arrays, JAX's own dispatch (the reference);
- `tpu eager`: the add on `tpu` tensors, op by op (dispatch, cache lookup, launch, wrap);
- `tpu fused record`: the add recorded into fused mode's pending graph (the flush excluded).
Variants run in rounds (A B C D, A B C D ...) so machine noise hits them alike; each
figure is the median over rounds, and the ratios are to `jax jit` of the same round.
`--clock cpu` times with the process's CPU time (all its threads) instead of the wall
clock: on a machine shared with other work, wall time mostly measures waiting.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

from _bench import header

CLOCK = time.perf_counter


def per_op(fn, n: int) -> float:
    t0 = CLOCK()
    for _ in range(n):
        fn()
    return (CLOCK() - t0) / n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter

    from tpu_agent.backend import lazy

    print(header(f"benchmarks/dispatch.py: per-op cost of x + y (64x64 float32), {args.clock} clock, "
                 f"median of {args.rounds} interleaved rounds of {args.ops} ops"), flush=True)

    a, b = torch.ones(64, 64), torch.ones(64, 64)
    x, y = a.to("tpu"), b.to("tpu")
    ja, jb = jnp.ones((64, 64)), jnp.ones((64, 64))
    add = jax.jit(jnp.add)

    def fused_record():
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            t0 = CLOCK()
            z = x
            for _ in range(100):  # a chain: what a model's step records
                z = z + y
            took = CLOCK() - t0
            lazy.RECORDER.flush("benchmark")
        return took / 100

    variants = {
        "torch cpu": lambda: per_op(lambda: a + b, args.ops),
        "jax jit": lambda: per_op(lambda: add(ja, jb), args.ops),
        "tpu eager": lambda: per_op(lambda: x + y, args.ops),
        "tpu fused record": lambda: statistics.median(fused_record() for _ in range(max(args.ops // 100, 3))),
    }
    for run in variants.values():  # warm-up: compile every program once
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        row = {name: run() for name, run in variants.items()}
        for name, t in row.items():
            times[name].append(t)
            ratios[name].append(t / row["jax jit"])
    print(f"{'variant':<18} {'per op':>10} {'x jax jit':>10}")
    for name in variants:
        print(f"{name:<18} {statistics.median(times[name]) * 1e6:>8.1f} us {statistics.median(ratios[name]):>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
