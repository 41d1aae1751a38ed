"""Train a small MLP on synthetic MNIST-shaped data.

    python examples/mlp.py --device cpu --steps 20
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 128
IN_FEATURES = 784  # 28 x 28 pixels
HIDDEN = 256
NUM_CLASSES = 10
NUM_BATCHES = 8  # a small fixed dataset, cycled


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_data(generator):
    # Labels come from a fixed random "teacher", so there is something to learn.
    x = torch.randn(NUM_BATCHES, BATCH, IN_FEATURES, generator=generator)
    teacher = torch.randn(IN_FEATURES, NUM_CLASSES, generator=generator)
    y = (x @ teacher).argmax(dim=-1)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    # Compile the training step into one program, or the model into forward and backward programs.
    parser.add_argument("--compile", choices=["none", "step", "model"], default="none")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    x, y = make_data(torch.Generator().manual_seed(args.seed))
    x, y = x.to(device), y.to(device)

    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    if args.compile == "model":
        model = torch.compile(model)

    def train_step(inputs, targets):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
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
