"""A forward+backward loop with no sync, eager vs fused: is fused mode's pending graph bounded?

    .venv/bin/python benchmarks/bounded_graph.py [--iters 300] [--rounds 5] [--max-graph-ops 1000]

The loop of issue #12, `loss = lin(x).sum(); loss.backward()` on a tpu `nn.Linear`, with no
optimizer step and no read of a value: nothing ends fused mode's pending graph but the graph
size limit (TPU_AGENT_MAX_GRAPH_OPS, 10000 ops by default; before it, the graph grew and
recompiled at every flush: 139 ms per iteration fused vs 1.1 ms eager). This script sets
TPU_AGENT_MAX_GRAPH_OPS to --max-graph-ops (1000 by default, so that a short run crosses it
several times and each graph compiles in seconds; 0 keeps the backend's own limit) before
the backend loads. A call of a variant runs --iters iterations, then reads one gradient
value (the one sync), with the gradients reset first. The first round (cold: fused mode
compiles its graphs there) is reported alone; the next --rounds rounds are interleaved
(eager, fused, eager, fused, ...) and give median ms per iteration, the median per-round
fused/eager ratio, and per fused call the graphs compiled (executables of kind "fused")
and the flushes at the size limit (RECORDER.breaks with reason lazy.SIZE_LIMIT).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300, help="loop iterations per call (per variant per round)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the cold one")
    parser.add_argument("--max-graph-ops", type=int, default=1000,
                        help="TPU_AGENT_MAX_GRAPH_OPS for this run; 0: the environment's or the backend's default")
    parser.add_argument("--dim", type=int, default=64, help="Linear(dim, dim) on a (32, dim) input")
    args = parser.parse_args(argv)
    if args.max_graph_ops:
        os.environ["TPU_AGENT_MAX_GRAPH_OPS"] = str(args.max_graph_ops)  # read when the backend loads: before torch

    import torch

    from _bench import header, interleaved, median_ms, ratio
    from tpu_agent.backend.core import executables, lazy

    limit = lazy.RECORDER.max_ops
    lin = torch.nn.Linear(args.dim, args.dim).to("tpu")
    x = torch.randn(32, args.dim).to("tpu")
    counts: list[tuple[int, int, float]] = []  # per fused call: graphs compiled, size-limit flushes, ops per iteration

    def loop():
        lin.weight.grad = lin.bias.grad = None
        for _ in range(args.iters):
            loss = lin(x).sum()
            loss.backward()
        lin.weight.grad[0, 0].item()  # the one sync

    def fused():
        graphs = sum(e.kind == "fused" for e in executables.all())
        breaks, order = len(lazy.RECORDER.breaks), lazy.RECORDER.order
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            loop()
        counts.append((sum(e.kind == "fused" for e in executables.all()) - graphs,
                       sum(b.reason == lazy.SIZE_LIMIT for b in lazy.RECORDER.breaks[breaks:]),
                       (lazy.RECORDER.order - order) / args.iters))

    print(header(f"benchmarks/bounded_graph.py: Linear({args.dim}, {args.dim}) forward+backward, no sync, "
                 f"{args.iters} iterations per call, graph size limit {limit} ops"
                 + (" (set by this script)" if args.max_graph_ops else "")), flush=True)
    variants = {"tpu eager": loop, "tpu fused": fused}
    cold = interleaved(variants, 1)
    times = interleaved(variants, args.rounds)
    per_iter = {name: [t / args.iters for t in ts] for name, ts in times.items()}
    graphs, flushes, ops = counts[0]
    print(f"  cold round: eager {cold['tpu eager'][0] / args.iters * 1e3:.2f} ms/iter, fused "
          f"{cold['tpu fused'][0] / args.iters * 1e3:.2f} ms/iter ({ratio(cold, 'tpu fused', 'tpu eager'):.1f}x eager); "
          f"fused compiled {graphs} graphs, {flushes} size-limit flushes, {ops:.1f} ops recorded per iteration")
    print(f"  {'variant':10s} {'ms/iter':>9s}   (median of {args.rounds} rounds)")
    for name in variants:
        print(f"  {name:10s} {median_ms(per_iter[name]):9.3f}")
    later = counts[1:]
    print(f"  fused/eager {ratio(times, 'tpu fused', 'tpu eager'):.2f}; per timed fused call: "
          f"{statistics.median(c[0] for c in later):g} graphs compiled (total {sum(c[0] for c in later)}), "
          f"{statistics.median(c[1] for c in later):g} size-limit flushes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
