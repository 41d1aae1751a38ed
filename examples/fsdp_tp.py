"""2-D parallel training, FSDP2 x tensor parallel, of a small Llama-style model, as a GPU script writes it
(device aside).

    torchrun --nproc-per-node 4 examples/fsdp_tp.py --dp 2                 # 2 x 2 mesh on the tpu device
    tpu-agent run --nproc 2 examples/fsdp_tp.py -- --dp 1                  # tensor parallel alone
    torchrun --nproc-per-node 4 examples/fsdp_tp.py --dp 2 --device cpu    # the same on CPU gloo

`init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`: each block's attention projections and
SwiGLU MLP are split over "tp" (`ColwiseParallel` for wq/wk/wv/w1/w3, `RowwiseParallel` for wo/w2: each rank
holds its share of the heads and of the hidden units), then each block and the root are sharded over "dp"
with `fully_shard`. Ranks with the same "dp" coordinate read the same batch. `--out DIR` writes each rank's
losses and final (full) parameters to DIR/rankN.json.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

VOCAB, DIM, HEADS, HIDDEN, LAYERS, SEQ, BATCH = 64, 32, 4, 64, 2, 16, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1: this rank's heads (all of them without tensor parallelism), as TorchTitan's Llama writes it
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


TP_PLAN = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
           "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
           "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel (FSDP) degree; tensor parallel: the rest")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="write rankN.json (losses, final parameters) here")
    args = parser.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.dp < 1 or world % args.dp or HEADS % (world // args.dp):
        print(f"error: --dp {args.dp} does not split {world} ranks into dp x tp with tp dividing {HEADS} heads",
              file=sys.stderr)
        sys.exit(2)
    mesh = init_device_mesh(args.device, (args.dp, world // args.dp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    model = Llama().to(args.device)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], TP_PLAN)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * dp_rank + step)  # one batch per dp coordinate
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1].to(args.device))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten().to(args.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"rank {rank} step {step} loss {losses[-1]:.6f}", flush=True)

    params = {name: p.full_tensor().detach().float().cpu().flatten().tolist() for name, p in model.named_parameters()}
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"losses": losses, "params": params}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
