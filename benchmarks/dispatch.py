"""Per-op cost of the bundled tpu device, as ratios from one run.

    .venv/bin/python benchmarks/dispatch.py [--rounds 7] [--ops 2000] [--clock wall|thread|cpu]

Three ops on 64x64 float32 tensors, each timed per op:
- `x + y` (a new tensor), `x @ w` (a matmul), `w.add_(y)` (in place: the tensor's value replaced);
- `torch cpu`: PyTorch's own CPU kernel (for scale);
- `jax jit`: the same op as a `jax.jit` call on JAX arrays, JAX's own dispatch (the reference; `w.add_(y)`'s is
  `w = add(w, y)`, what an in-place op is on immutable arrays);
- `tpu eager`: the op on `tpu` tensors, op by op (PyTorch's dispatch, ours, the cached program's launch, the
  new tensor);
- `fused record`: `x + y` recorded into fused mode's pending graph (the flush excluded).
Variants run in rounds (each variant once per round, the same order) so that machine noise hits them alike;
each figure is the median over rounds, and a ratio is the median of the ratios within a round.

Clocks: `wall` (default: what a user waits for). `thread`: this thread's CPU time, the Python that PyTorch, the
device and JAX's dispatch run, without XLA's worker threads (which run the op, and spin while they wait for
the next one); on a loaded machine it moves less than the wall clock. `cpu`: the process's CPU time, all threads,
the workers' spinning included.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import torch

from _bench import header, target

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time, "cpu": time.process_time}
OPS = ("x + y", "x @ w", "w.add_(y)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", type=int, default=2000, help="ops per variant per round")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    args = parser.parse_args(argv)
    clock = CLOCKS[args.clock]

    from tpu_agent.backend.core import lazy

    print(header(f"benchmarks/dispatch.py: per-op cost, 64x64 float32, {args.clock} clock, "
                 f"median of {args.rounds} interleaved rounds of {args.ops} ops"), flush=True)

    def per_op(fn) -> float:
        t0 = clock()
        for _ in range(args.ops):
            fn()
        return (clock() - t0) / args.ops

    a, b, c = torch.ones(64, 64), torch.ones(64, 64), torch.full((64, 64), 0.5)
    x, y, w = a.to("tpu"), b.to("tpu"), c.to("tpu")
    ja, jb, jc = jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.full((64, 64), 0.5)
    add, matmul = jax.jit(jnp.add), jax.jit(jnp.matmul)
    state = {"jw": jc}

    def jax_add_in_place():
        state["jw"] = add(state["jw"], jb)

    def fused_record():
        chain = max(args.ops // 20, 10)
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            t0 = clock()
            z = x
            for _ in range(chain):  # a chain: what a model's step records
                z = z + y
            took = clock() - t0
            lazy.RECORDER.flush("benchmark")
        return took / chain

    variants = {
        ("x + y", "torch cpu"): lambda: per_op(lambda: a + b),
        ("x + y", "jax jit"): lambda: per_op(lambda: add(ja, jb)),
        ("x + y", "tpu eager"): lambda: per_op(lambda: x + y),
        ("x + y", "fused record"): lambda: statistics.median(fused_record() for _ in range(20)),
        ("x @ w", "torch cpu"): lambda: per_op(lambda: a @ c),
        ("x @ w", "jax jit"): lambda: per_op(lambda: matmul(ja, jc)),
        ("x @ w", "tpu eager"): lambda: per_op(lambda: x @ w),
        ("w.add_(y)", "torch cpu"): lambda: per_op(lambda: c.add_(b)),
        ("w.add_(y)", "jax jit"): lambda: per_op(jax_add_in_place),
        ("w.add_(y)", "tpu eager"): lambda: per_op(lambda: w.add_(y)),
    }
    for run in variants.values():  # warm-up: compile every program once
        run()
    times: dict[tuple, list[float]] = {key: [] for key in variants}
    ratios: dict[tuple, list[float]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        row = {key: run() for key, run in variants.items()}
        for (op, name), t in row.items():
            times[op, name].append(t)
            ratios[op, name].append(t / row[op, "jax jit"])

    def us(key) -> str:
        return f"{statistics.median(times[key]) * 1e6:.1f} us" if key in times else "-"

    print(f"{'op':<10} {'torch cpu':>10} {'jax jit':>10} {'tpu eager':>10} {'eager/jit':>10} {'fused record':>13}")
    for op in OPS:
        eager = statistics.median(ratios[op, "tpu eager"])
        print(f"{op:<10} {us((op, 'torch cpu')):>10} {us((op, 'jax jit')):>10} {us((op, 'tpu eager')):>10} "
              f"{eager:>9.2f}x {us((op, 'fused record')):>13}")
    print("targets: " + ", ".join([
        target(f"eager {op} / jax jit", statistics.median(ratios[op, "tpu eager"]), "<=", 1.5) for op in OPS]
        + [target("fused record (us)", statistics.median(times["x + y", "fused record"]) * 1e6, "<=", 5)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
