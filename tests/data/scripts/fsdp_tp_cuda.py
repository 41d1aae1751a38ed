"""FSDP2 x tensor parallel as a GPU script writes it: `init_process_group("cpu:gloo,cuda:nccl")`,
`set_device(LOCAL_RANK)`, `init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))`;
gloo and a "cpu" mesh where CUDA is not available.

    torchrun --nproc-per-node 2 fsdp_tp_cuda.py --out DIR                          # CPU gloo (no CUDA here)
    tpu-agent run --nproc 2 --device-map cuda=tpu fsdp_tp_cuda.py -- --out DIR     # the same on tpu

examples/fsdp2.py's model; each block's MLP is split over "tp" (`ColwiseParallel` up, `RowwiseParallel` down), then every block and the
root are sharded over "dp" with `fully_shard`. Every rank writes DIR/rankN.json: per-step losses, the full
final parameters, and the mesh's device type.
"""

import argparse
import json
import os

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from fsdp2 import BATCH, CLASSES, WIDTH, Net  # noqa: E402 - the example's model: only the GPU idioms differ

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (dp = world size / tp)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    model = Net().to("cuda" if cuda else "cpu")
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    teacher = torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(7))
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * dp_rank + step)  # a dp rank's batch; the same across its tp ranks
        x = torch.randn(BATCH, WIDTH, generator=g)
        y = (x @ teacher).argmax(-1)
        loss = F.cross_entropy(model(x.cuda() if cuda else x), y.cuda() if cuda else y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    params = {name: p.full_tensor().detach().cpu().flatten().tolist() for name, p in model.named_parameters()}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "params": params, "mesh_device": mesh.device_type,
                   "backend": str(dist.get_backend())}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
