"""What `tpu-agent profile --nproc N`'s collective timing costs: tpu all-reduces with the backend's recording off
and on, interleaved in one job, and how much of the wall time the recorded times account for.

    .venv/bin/python benchmarks/collective_timing.py [--nproc 2] [--rounds 7]

Recording on (backend/distributed/collectives.py `record(True)`, what the profiler switches on) makes each
collective wait for its input, then for its result. A round times `iters` back-to-back all-reduces of one
float32 buffer, then `torch.tpu.synchronize()`; its time is the slowest rank's (a gloo all-reduce of the
ranks' times). Off and on alternate round by round (the machine's noise hits both alike); a figure is the
median over rounds, the ratio the median of the rounds' on / off ratios. `recorded / wall`: the recorded
collective time over the round's wall time on rank 0 (below 1: the rest is the loop, the timer, the sync).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from _bench import header
from collectives import finish, launch, load_line, slowest

KB = 1024
SIZES = (4 * KB, 256 * KB, 4 * KB * KB)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from tpu_agent.backend.distributed import collectives

    dist.init_process_group()
    rank = dist.get_rank()
    torch.tpu.set_device(0)
    rows = []
    for size in SIZES:
        x = torch.ones(size // 4, device="tpu")
        iters = max(4, min(50, (4 * KB * KB) // size))
        times: dict[bool, list[float]] = {False: [], True: []}
        shares = []
        for round_ in range(args.rounds + 1):  # round 0 warms up (compiles the program)
            for on in (False, True):
                collectives.record(on)
                before = sum(t.seconds for t in collectives.RECORDED.totals.values())
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x)
                torch.tpu.synchronize()
                wall = time.perf_counter() - t0
                collectives.record(False)
                if round_:
                    times[on].append(slowest(wall) / iters)
                    if on:
                        shares.append((sum(t.seconds for t in collectives.RECORDED.totals.values()) - before) / wall)
                else:
                    slowest(wall)
        ratio = statistics.median(b / a for a, b in zip(times[False], times[True]))
        rows.append((size, iters, statistics.median(times[False]), statistics.median(times[True]), ratio,
                     statistics.median(shares)))
    if rank == 0:
        print(f"\n{dist.get_world_size()} ranks, all_reduce, median of {args.rounds} rounds (time per call, slowest rank)")
        print(f"{'size':>8}{'iters':>6}{'off ms':>10}{'on ms':>10}{'on/off':>8}{'recorded/wall':>15}")
        for size, iters, off, on, ratio, share in rows:
            shown = f"{size // KB} KB" if size < KB * KB else f"{size // (KB * KB)} MB"
            print(f"{shown:>8}{iters:>6}{off * 1e3:>10.3f}{on * 1e3:>10.3f}{ratio:>8.2f}{share:>15.2f}", flush=True)
    finish()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # set for the ranks
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args)
        return 0
    print(header("collective timing of tpu-agent profile --nproc: recording off vs on"))
    print(load_line("start"), flush=True)
    code = launch(args.nproc, __file__, ["--rank", "--rounds", str(args.rounds)])
    print(load_line("end"))
    return code


if __name__ == "__main__":
    sys.exit(main())
