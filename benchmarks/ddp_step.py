"""A DistributedDataParallel training step on the tpu backend against the same step on CPU gloo, in one run.

    .venv/bin/python benchmarks/ddp_step.py [--nproc 2] [--mode eager|fused|compiled] [--steps 10] [--batch 64]

Starts PyTorch's launcher on itself (`python -m torch.distributed.run --standalone --nproc-per-node N`).
Every rank calls `init_process_group()` with no backend (the tpu backend; CPU tensors' collectives go to the
gloo backend its group holds) and builds the same 4-layer, width-1024 MLP twice from one seed: one copy on
tpu, one on the CPU, each wrapped in DDP. A step is forward, cross-entropy, backward (DDP all-reduces the
gradients: 3 x (1024 x 1024 + 1024) + 1024 x 10 + 10 float32 values, 12.6 MB, through the tpu backend or gloo)
and an SGD update, on the rank's own batch; the tpu step ends with `torch.tpu.synchronize()`. The two
alternate step by step (tpu, cpu, tpu, cpu ...) so the machine's noise hits them alike; a step's time is the
slowest rank's, the figure the median over steps after 3 warm-up steps, the ratio the median of the steps' tpu
/ cpu ratios. The two models' losses are compared (they train the same model on the same data).
`--mode` sets how the tpu side executes: eager (op by op), fused (TORCH_TPU_DEFER_AND_FUSE=1) or compiled
(TPU_AGENT_COMPILE_STEPS=1). `--torch-threads` as in the other benchmarks (the launcher sets 1 by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from _bench import header
from collectives import finish, launch, load_line, slowest

WIDTH, LAYERS, CLASSES = 1024, 4, 10
WARMUP = 3
MODES = {"eager": {}, "fused": {"TORCH_TPU_DEFER_AND_FUSE": "1"}, "compiled": {"TPU_AGENT_COMPILE_STEPS": "1"}}


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.tpu.set_device(0)

    def mlp() -> nn.Module:
        layers = []
        for _ in range(LAYERS - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))

    sides = {}
    for device in ("tpu", "cpu"):
        torch.manual_seed(0)
        model = DDP(mlp().to(device))
        sides[device] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def step(device: str, x, y) -> float:
        model, optimizer = sides[device]
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device == "tpu":
            torch.tpu.synchronize()
        elapsed = time.perf_counter() - t0
        losses[device].append(loss.item())  # after the clock: reading the loss is not the step's
        return elapsed

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    losses: dict[str, list[float]] = {"tpu": [], "cpu": []}
    times: dict[str, list[float]] = {"tpu": [], "cpu": []}
    for i in range(WARMUP + args.steps):
        x = torch.randn(args.batch, WIDTH, generator=g)
        y = torch.randint(0, CLASSES, (args.batch,), generator=g)
        for device in ("tpu", "cpu"):
            dist.barrier()  # gloo: every rank starts the step together
            elapsed = slowest(step(device, x, y))
            if i >= WARMUP:
                times[device].append(elapsed)
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses["tpu"], losses["cpu"]))
    if rank == 0:
        t_tpu, t_cpu = statistics.median(times["tpu"]), statistics.median(times["cpu"])
        ratio = statistics.median(a / b for a, b in zip(times["tpu"], times["cpu"]))
        print(f"\n{n} ranks, tpu {args.mode}, batch {args.batch} per rank, median of {args.steps} steps after "
              f"{WARMUP} warm-up (the slowest rank's time)")
        print(f"tpu  {t_tpu * 1e3:9.2f} ms/step\ncpu  {t_cpu * 1e3:9.2f} ms/step (gloo)\n"
              f"tpu/cpu {ratio:.2f}   loss drift tpu vs cpu {drift:.1e} (relative, worst step)", flush=True)
    finish()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="world size (default 2)")
    parser.add_argument("--mode", choices=list(MODES), default="eager", help="the tpu side's execution")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--batch", type=int, default=64, help="batch per rank (default 64)")
    parser.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads on each rank")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # started by the launcher: one rank
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        rank_main(args)
        return 0
    if args.nproc < 2 or args.steps < 1 or args.batch < 1:
        print("error: --nproc takes 2 or more; --steps and --batch at least 1", file=sys.stderr)
        return 2
    print(header(f"benchmarks/ddp_step.py: DDP step of a {LAYERS}-layer width-{WIDTH} MLP, tpu backend vs CPU "
                 f"gloo, {args.nproc} ranks, tpu {args.mode}"))
    print(load_line("start"), flush=True)
    forwarded = ["--mode", args.mode, "--steps", str(args.steps), "--batch", str(args.batch)]
    if args.torch_threads:
        forwarded += ["--torch-threads", str(args.torch_threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_TPU_DEFER_AND_FUSE", "TPU_AGENT_COMPILE_STEPS")}
    status = launch(args.nproc, __file__, forwarded, env={**env, **MODES[args.mode]})
    print(load_line("end"))
    return status


if __name__ == "__main__":
    sys.exit(main())
