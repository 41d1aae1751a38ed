"""Fully sharded data parallel training with FSDP2 (`fully_shard`), as a GPU script writes it (device aside).

    torchrun --nproc-per-node 2 examples/fsdp2.py                  # on the tpu device
    tpu-agent run --nproc 2 examples/fsdp2.py -- --bf16
    torchrun --nproc-per-node 2 examples/fsdp2.py --device cpu     # the same on CPU gloo

Each block is sharded, then the root (`fully_shard` per block and on the model); every rank holds half of
each parameter, all-gathers a block's parameters for its forward and backward and reduce-scatters its
gradients. `--bf16`: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32);
`--no-reshard-after-forward` keeps the gathered parameters from forward to backward. `--out DIR` writes
each rank's losses and final (full) parameters to DIR/rankN.json.

    torchrun --nproc-per-node 2 examples/fsdp2.py --checkpoint ckpt --save-at 3   # save after step 3
    torchrun --nproc-per-node 2 examples/fsdp2.py --checkpoint ckpt --resume      # steps 3.. from there

`--save-at K` saves the sharded model and optimizer state after K steps with torch.distributed.checkpoint
(each rank writes its own shards); `--resume` loads it into a freshly sharded model and continues from step K.
Rank r's batch at step s depends only on (r, s), so a resumed run sees the batches the uninterrupted one did.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WIDTH, BLOCKS, CLASSES, BATCH = 64, 3, 8, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 parameters, float32 gradient reduction")
    parser.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false")
    parser.add_argument("--out", help="write rankN.json (losses, final parameters) here")
    parser.add_argument("--checkpoint", help="a torch.distributed.checkpoint directory (with --save-at or --resume)")
    parser.add_argument("--save-at", type=int, help="save the sharded state there after this many steps")
    parser.add_argument("--resume", action="store_true", help="load the sharded state from there and continue")
    args = parser.parse_args()
    if (args.save_at is not None or args.resume) and not args.checkpoint:
        print("error: --save-at and --resume need --checkpoint DIR", file=sys.stderr)
        sys.exit(2)

    dist.init_process_group()
    rank = dist.get_rank()
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = Net().to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=args.reshard, mp_policy=mp)
    fully_shard(model, reshard_after_forward=args.reshard, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start = 0
    if args.resume:  # each rank reads its own shards into the sharded model and optimizer
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": 0}
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["step"]

    teacher = torch.randn(WIDTH, CLASSES, generator=torch.Generator().manual_seed(7))
    losses = []
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data, the same on resuming
        x = torch.randn(BATCH, WIDTH, generator=g)
        y = (x @ teacher).argmax(-1)
        loss = F.cross_entropy(model(x.to(device)).float(), y.to(device))  # the loss in float32, as TorchTitan's
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"rank {rank} step {step} loss {losses[-1]:.6f}", flush=True)
        if step + 1 == args.save_at:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state, "step": step + 1}, checkpoint_id=args.checkpoint)

    params = {name: p.full_tensor().detach().float().cpu().flatten().tolist() for name, p in model.named_parameters()}
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"first_step": start, "losses": losses, "params": params}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
