"""Train an MLP whose sizes are all one off the hardware-friendly ones.

Batch 127 and widths 1023 / 2047 leave TPU tiles (and CPU vector lanes)
partly empty; `tpu-agent` is meant to find and pad them. Keep each size a
plain integer literal: the tuner rewrites these literals on a copy. (The
earlier examples/odd_shapes.py: tests/data/profile_odd_mlp.json is its profile.)
    python tests/data/scripts/odd_mlp.py --device cpu --steps 20
"""

import argparse

import torch
import torch.nn as nn

BATCH = 127
IN_FEATURES = 1023
HIDDEN = 2047
BOTTLENECK = 1023
NUM_CLASSES = 10
NUM_BATCHES = 4


def build_model():
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, BOTTLENECK),
        nn.GELU(),
        nn.Linear(BOTTLENECK, NUM_CLASSES),
    )


def make_data(generator):
    x = torch.randn(NUM_BATCHES, BATCH, IN_FEATURES, generator=generator)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=generator)
    y = (x @ teacher).argmax(dim=-1)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-4)
    # Compile the training step into one program, or the model into forward and backward programs.
    parser.add_argument("--compile", choices=["none", "step", "model"], default="none")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    x, y = make_data(torch.Generator().manual_seed(args.seed))
    x, y = x.to(device), y.to(device)

    model = build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    if args.compile == "model":
        model = torch.compile(model)

    def train_step(inputs, targets):
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    if args.compile == "step":
        train_step = torch.compile(train_step)

    model.train()
    for step in range(args.steps):
        i = step % NUM_BATCHES
        loss = train_step(x[i], y[i])
        print(f"step={step} loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
