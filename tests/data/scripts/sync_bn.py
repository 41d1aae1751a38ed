"""SyncBatchNorm under DistributedDataParallel, as a GPU script writes it (device aside): each rank trains on
its own batches, the batch statistics are those of all ranks' batches together, and the running statistics
follow them. `--out DIR` writes each rank's per-step losses, its BatchNorm buffers and its evaluation logits
to DIR/rankN.json.

    tpu-agent run --nproc 2 sync_bn.py -- --out DIR

PyTorch runs SyncBatchNorm on CUDA and PrivateUse1 devices only (DDP refuses it on the CPU). Its reference is
`reference(world)`: one process on the CPU, plain BatchNorm over all ranks' batches concatenated and the mean of
the ranks' losses, which is what SyncBatchNorm with DDP's averaged gradients computes.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(6)
        self.bn1d = nn.BatchNorm1d(6, momentum=None)  # the cumulative average
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1).flatten(1)
        return self.head(F.relu(self.bn1d(x)))


def batches(rank: int, steps: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    return [(torch.randn(6, 3, 8, 8, generator=g) * 1.5 + 0.5, torch.randint(0, 5, (6,), generator=g))
            for _ in range(steps)]


def evaluation_batch():
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(7))


def reference(world: int = 2, steps: int = 4) -> dict:
    """Each rank's losses, and the buffers and evaluation logits every rank holds, from one CPU process."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_rank = [batches(r, steps) for r in range(world)]
    losses = [[] for _ in range(world)]
    for step in range(steps):
        x = torch.cat([per_rank[r][step][0] for r in range(world)])
        y = torch.cat([per_rank[r][step][1] for r in range(world)])
        out = model(x)
        parts = [F.cross_entropy(o, t) for o, t in zip(out.chunk(world), y.chunk(world))]
        torch.stack(parts).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        for r, part in enumerate(parts):
            losses[r].append(part.item())
    model.eval()
    with torch.no_grad():
        logits = model(evaluation_batch())
    return {"losses": losses, "logits": logits.flatten().tolist(),
            "buffers": {k: v.detach().flatten().tolist() for k, v in model.state_dict().items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group()
    rank = dist.get_rank()
    device = torch.device("tpu")
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).to(device)
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches(rank, args.steps):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(evaluation_batch().to(device)).cpu()
    inner = model.module
    out = {"losses": losses, "logits": logits.flatten().tolist(),
           "buffers": {k: v.detach().cpu().flatten().tolist() for k, v in inner.state_dict().items()},
           "sync": type(inner.bn).__name__}
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
