"""Data-parallel training with DistributedDataParallel, as a GPU script writes it (device aside).

    torchrun --nproc-per-node 2 examples/ddp.py                   # on the tpu device
    tpu-agent run --nproc 2 examples/ddp.py -- --steps 8
    torchrun --nproc-per-node 2 examples/ddp.py --device cpu      # the same on CPU gloo
    tpu-agent run --nproc 2 --device-map cuda=tpu examples/ddp.py -- --device cuda   # a CUDA script, on tpu

Each rank reads its own shard of the data (DistributedSampler), accumulates gradients over
`--accum` micro-batches with `no_sync()` (one all-reduce per optimizer step), and prints its
per-step loss; `--out DIR` also writes each rank's losses and final parameters to DIR/rankN.json.

`--device cuda` is the script as it runs on GPUs: NCCL (`--init` picks one of the spellings GPU scripts use),
`torch.cuda.set_device(LOCAL_RANK)`, `cuda:LOCAL_RANK`, `device_ids=[LOCAL_RANK]`, `.cuda()`, and a group of its
own with one all-reduce, whose backend and result rankN.json records; where CUDA is not available it runs on
CPU gloo.
"""

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES, HIDDEN, CLASSES, SAMPLES = 32, 64, 4, 512


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(-1)  # a teacher's labels: something to learn
    return TensorDataset(x, y)


def init_cuda(how: str, local_rank: int) -> torch.device:
    """A GPU script's start: NCCL and the rank's own GPU (CPU gloo where CUDA is not available)."""
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return torch.device("cpu")
    if how == "positional":
        dist.init_process_group("nccl")
    elif how == "keyword":  # PyTorch's advice since 2.3: bind the group to the rank's device
        dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl")
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    assert torch.device(f"cuda:{local_rank}") == device
    return device


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="tpu", help="tpu (default), cpu, or cuda (as a GPU script runs)")
    parser.add_argument("--init", choices=("positional", "keyword", "pair"), default="positional",
                        help="--device cuda: init_process_group('nccl'), (backend='nccl', device_id=...) or "
                             "('cpu:gloo,cuda:nccl')")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=16, help="micro-batch per rank")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--out", help="write rankN.json (losses, final parameters) here")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        device = init_cuda(args.init, local_rank)
    else:
        dist.init_process_group()  # no backend named: PyTorch picks the device's (tpu here, gloo for CPU tensors)
        device = torch.device(args.device)
        if device.type == "tpu":
            torch.tpu.set_device(0)  # one tpu device per process; LOCAL_RANK picks the host's chip on TPU hosts
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda" and torch.cuda.is_available()  # under a device map, cuda names another device

    torch.manual_seed(0)
    # rank 0's parameters are broadcast to every rank here
    model = DDP(MLP().to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    losses, step, epoch = [], 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.cuda(non_blocking=True) if cuda else x.to(device), y.to(device)
            last = (i + 1) % args.accum == 0
            with contextlib.nullcontext() if last else model.no_sync():  # all-reduce once per step
                loss = F.cross_entropy(model(x), y) / args.accum
                loss.backward()
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item() * args.accum)
            print(f"rank {rank} step {step} loss {losses[-1]:.6f}", flush=True)
            step += 1
            if step == args.steps:
                break
        epoch += 1

    record = {"losses": losses}
    if args.device == "cuda":  # a collective the script issues itself, on its device, in a group of its own
        total = torch.tensor([float(rank + 1)], device=device)
        everyone = dist.new_group()  # inherits the default group's backend
        dist.all_reduce(total, group=everyone)
        record.update(backend=str(dist.get_backend()), new_group_backend=str(dist.get_backend(everyone)),
                      tensor_device=total.device.type, is_cuda=total.is_cuda, total=total.item())
    if args.out:
        record["params"] = {name: p.detach().cpu().flatten().tolist() for name, p in model.module.named_parameters()}
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
    dist.barrier()  # every rank done before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
