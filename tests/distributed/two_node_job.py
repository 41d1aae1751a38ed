"""One rank of tests/distributed/test_two_nodes.py's job: `torchrun --nnodes 2 --node-rank k --nproc-per-node 2`,
TPU_AGENT_DEVICES=2 (two simulated devices per process), the tool loaded by `import torch`.

Each rank trains the same small model four ways, each from the same initial weights: DDP and FSDP2 on CPU
tensors with gloo (the reference), then DDP and FSDP2 on tpu. It asserts the JAX devices it owns (two, its own
process's, no other rank's) and writes OUT/rankN.json with every run's per-step losses and its device ids.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, CLASSES, BATCH, STEPS = 32, 8, 8, 3


def net():
    torch.manual_seed(0)
    # Two layers of one shape: their programs are shared (ranks other than 0 compile each op's program anew:
    # JAX's persistent cache is written by process 0, keyed by the devices a program runs on).
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, CLASSES))


def train(kind: str, device: str, rank: int, world: int) -> list[float]:
    model = net().to(device)
    if kind == "ddp":
        model = DDP(model)
    else:
        mesh = init_device_mesh(device, (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    teacher = torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(7))
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own batch
        x = torch.randn(BATCH, WIDTH, generator=g)
        y = (x @ teacher).argmax(-1)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    out = sys.argv[1]
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {f"{kind}-cpu": train(kind, "cpu", rank, world) for kind in ("ddp", "fsdp2")}
    runs.update({f"{kind}-tpu": train(kind, "tpu", rank, world) for kind in ("ddp", "fsdp2")})

    import jax  # the tool's JAX runtime, joined by the first tpu op

    mine = jax.local_devices()
    assert jax.process_count() == world and jax.process_index() == rank, (jax.process_count(), jax.process_index())
    assert len(mine) == int(os.environ["TPU_AGENT_DEVICES"]), mine
    assert all(d.process_index == rank for d in mine), mine
    ids = [d.id for d in mine]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, ids)
    flat = [i for ids_ in everyone for i in ids_]
    assert len(flat) == len(set(flat)), f"two ranks share a device: {everyone}"
    assert sorted(flat) == sorted(d.id for d in jax.devices()), (everyone, jax.devices())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"runs": runs, "devices": ids, "everyone": everyone, "local_rank": int(os.environ["LOCAL_RANK"]),
                   "node": int(os.environ["GROUP_RANK"])}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
