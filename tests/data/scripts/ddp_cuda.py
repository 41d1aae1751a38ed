"""examples/ddp.py as a GPU script writes it: NCCL, `torch.cuda.set_device(LOCAL_RANK)`, `cuda:LOCAL_RANK`,
`device_ids=[LOCAL_RANK]`; gloo on the CPU where CUDA is not available.

    torchrun --nproc-per-node 2 ddp_cuda.py --out DIR                          # CPU gloo (no CUDA here)
    tpu-agent run --nproc 2 --device-map cuda=tpu ddp_cuda.py -- --out DIR     # the same on tpu

`--init` picks how the process group is started (each a spelling GPU scripts use); every rank writes
DIR/rankN.json with its per-step losses, final parameters and what `dist.get_backend()` answered.
"""

import argparse
import contextlib
import json
import os

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from ddp import MLP, dataset  # noqa: E402 - the example's model and data: only the GPU idioms differ


def init(how: str, cuda: bool, local_rank: int) -> None:
    if not cuda:
        dist.init_process_group("gloo")
    elif how == "positional":
        dist.init_process_group("nccl")
    elif how == "keyword":  # PyTorch's advice since 2.3: bind the group to the rank's device
        dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("cpu:gloo,cuda:nccl")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=("positional", "keyword", "pair"), default="positional")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    init(args.init, cuda, local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        assert torch.device(f"cuda:{local_rank}") == device
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)
    model = DDP(MLP().to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)

    losses, step = [], 0
    for i, (x, y) in enumerate(loader):
        x, y = x.cuda(non_blocking=True) if cuda else x, y.to(device)
        last = (i + 1) % args.accum == 0
        with contextlib.nullcontext() if last else model.no_sync():
            loss = F.cross_entropy(model(x), y) / args.accum
            loss.backward()
        if not last:
            continue
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() * args.accum)
        step += 1
        if step == args.steps:
            break

    total = torch.tensor([float(rank + 1)], device=device)
    everyone = dist.new_group()  # inherits the default group's backend
    dist.all_reduce(total, group=everyone)  # a collective the script issues itself, on its device
    params = {name: p.detach().cpu().flatten().tolist() for name, p in model.module.named_parameters()}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "params": params, "backend": str(dist.get_backend()),
                   "new_group_backend": str(dist.get_backend(everyone)),
                   "tensor_device": total.device.type, "is_cuda": total.is_cuda, "total": total.item()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
