"""All-reduce and all-gather bus bandwidth of the tpu process-group backend against gloo on CPU tensors, in one run.

    .venv/bin/python benchmarks/collectives.py [--nproc 2 4] [--max-mb 64] [--rounds 5]

For each world size N it starts PyTorch's launcher on itself (`python -m torch.distributed.run --standalone
--nproc-per-node N`). Every rank calls `init_process_group()` with no backend: the tpu backend, whose group
runs tpu tensors' collectives as XLA collectives across the ranks' JAX processes and CPU tensors' with the
gloo backend it holds, so both are measured in the same job, interleaved (tpu, gloo, tpu, gloo ...: the
machine's noise hits them alike). float32 buffers of 1 KB to --max-mb MB, powers of 4.

A round times `iters` back-to-back collectives (fewer for larger buffers), the tpu ones followed by
`torch.tpu.synchronize()`; the time of a round is the slowest rank's (a gloo all-reduce of the ranks'
times), a figure is the median over rounds and the ratio the median of the rounds' tpu / gloo ratios. Bus
bandwidth as nccl-tests defines it, with S the buffer's bytes (all_gather: the gathered output, each rank
giving S/N): all_reduce S/t * 2(N-1)/N, all_gather S/t * (N-1)/N. Goal (issue #26): tpu within 1.5x of
gloo's time from 1 MB up.

`--bare` also times, interleaved with the others, XLA's all-reduce alone: a jitted `shard_map` psum on a
global array built once, outside the backend (no torch tensor, no write back), its ratio to gloo in a last
column: what the backend could reach with XLA:CPU's collectives as they are.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from _bench import header

KB = 1024


def sizes(max_mb: int) -> list[int]:
    out, size = [], KB
    while size <= max_mb * KB * KB:
        out.append(size)
        size *= 4
    return out


def label(size: int) -> str:
    return f"{size // (KB * KB)} MB" if size >= KB * KB else f"{size // KB} KB"


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def iterations(size: int) -> int:
    """Enough calls that a round of small buffers is not just the timer's and the barrier's noise."""
    return max(2, min(50, (4 * KB * KB) // size))


def slowest(seconds: float) -> float:
    """The largest of the ranks' `seconds` (a gloo all-reduce of a CPU tensor)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def finish() -> None:
    """Every rank done before the group goes."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def launch(nproc: int, script: str, args: list[str], env: dict[str, str] | None = None) -> int:
    """`script ARGS` on `nproc` ranks under PyTorch's launcher; its exit status."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), os.path.abspath(script), *args], env=env).returncode


def load_line(when: str) -> str:
    return f"load average at the {when}: {' '.join(f'{x:.1f}' for x in os.getloadavg())}"


def bare_psum(x):
    """A call running XLA's all-reduce of tpu tensor `x`'s array, alone (its program and global array built
    here, once)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpu_agent.backend.distributed import collectives, tensor_ops

    ranks = tuple(range(jax.process_count()))
    mesh = collectives.mesh_of(ranks)
    local = tensor_ops.array(x)
    whole = jax.make_array_from_single_device_arrays((len(ranks) * local.shape[0],),
                                                     NamedSharding(mesh, P(collectives.AXIS)), [local])
    program = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, collectives.AXIS), mesh=mesh,
                                    in_specs=P(collectives.AXIS), out_specs=P(collectives.AXIS)))
    return lambda: program(whole).block_until_ready()


def rank_main(args) -> None:
    """One rank: both backends over every size and op; rank 0 prints the table."""
    import torch
    import torch.distributed as dist

    dist.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.tpu.set_device(0)

    rows = []
    for op in ("all_reduce", "all_gather"):
        for size in sizes(args.max_mb):
            numel = size // 4
            buffers = {}
            for name, device in (("tpu", "tpu"), ("gloo", "cpu")):
                if op == "all_reduce":
                    x = torch.full((numel,), float(rank + 1), device=device)
                    buffers[name] = (lambda x=x: dist.all_reduce(x)), x
                    if args.bare and name == "tpu":
                        buffers["bare"] = bare_psum(torch.full((numel,), float(rank + 1), device=device)), None
                else:
                    mine = torch.full((numel // n,), float(rank + 1), device=device)
                    out = torch.empty(numel // n * n, device=device)
                    buffers[name] = (lambda out=out, mine=mine: dist.all_gather_into_tensor(out, mine)), out
            iters = iterations(size)
            times: dict[str, list[float]] = {name: [] for name in buffers}
            for round_ in range(args.rounds + 1):  # round 0 warms up (compiles the tpu programs)
                for name, (call, _) in buffers.items():
                    dist.barrier()  # gloo: every rank starts together
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        call()
                    if name == "tpu":
                        torch.tpu.synchronize()
                    elapsed = slowest(time.perf_counter() - t0) / iters
                    if round_:
                        times[name].append(elapsed)
            # The results agree: the tpu buffer holds what gloo's does (all_reduce summed over many calls).
            tpu_out, gloo_out = buffers["tpu"][1].cpu(), buffers["gloo"][1]
            if not torch.allclose(tpu_out, gloo_out, rtol=1e-5):
                raise SystemExit(f"error: {op} {label(size)}: tpu and gloo results differ")
            t_tpu, t_gloo = statistics.median(times["tpu"]), statistics.median(times["gloo"])
            ratio = statistics.median(a / b for a, b in zip(times["tpu"], times["gloo"]))
            bare = statistics.median(a / b for a, b in zip(times["bare"], times["gloo"])) if "bare" in times else None
            rows.append((op, size, iters, t_tpu, t_gloo, ratio, bare))
    if rank == 0:
        print(f"\n{n} ranks, median of {args.rounds} rounds (time per call of the slowest rank; busbw GB/s)")
        print(f"{'op':<11}{'size':>7}{'iters':>6}{'tpu ms':>10}{'gloo ms':>10}{'tpu busbw':>11}{'gloo busbw':>12}"
              f"{'tpu/gloo':>10}{'  bare psum/gloo' if args.bare else ''}")
        for op, size, iters, t_tpu, t_gloo, ratio, bare in rows:
            f = bus_factor(op, n) * size / 1e9
            goal = "" if size < KB * KB else ("  met" if ratio <= 1.5 else "  MISS (goal <= 1.5)")
            print(f"{op:<11}{label(size):>7}{iters:>6}{t_tpu * 1e3:>10.3f}{t_gloo * 1e3:>10.3f}{f / t_tpu:>11.3f}"
                  f"{f / t_gloo:>12.3f}{ratio:>10.2f}{goal}{'' if bare is None else f'  bare {bare:.2f}'}", flush=True)
    finish()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)")
    parser.add_argument("--max-mb", type=int, default=64, help="largest buffer, MB (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per size (default 5)")
    parser.add_argument("--bare", action="store_true", help="also time XLA's all-reduce alone (a bare psum)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # started by the launcher: one rank
        rank_main(args)
        return 0
    if any(n < 2 for n in args.nproc) or args.max_mb < 1 or args.rounds < 1:
        print("error: --nproc takes world sizes of 2 or more; --max-mb and --rounds at least 1", file=sys.stderr)
        return 2
    print(header(f"benchmarks/collectives.py: tpu backend vs gloo (CPU tensors), world sizes {args.nproc}"))
    print(load_line("start"), flush=True)
    for n in args.nproc:
        status = launch(n, __file__, ["--max-mb", str(args.max_mb), "--rounds", str(args.rounds),
                                      *(["--bare"] if args.bare else [])])
        if status != 0:
            return status
    print(load_line("end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
