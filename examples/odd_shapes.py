"""Train a small CNN whose sizes are all one off the hardware-friendly ones.

Batch 50, channel counts 63 and 127 and a 255-wide hidden layer leave TPU
tiles (and CPU vector lanes) partly empty; `tpu-agent` is meant to find and
pad them. Keep each size a plain integer literal: the tuner rewrites these
literals on a copy.

    python examples/odd_shapes.py --device cpu --steps 20
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 50
CHANNELS = 3
IMAGE_SIZE = 16
WIDTH = 63
WIDE = 127
HIDDEN = 255
NUM_CLASSES = 10
NUM_BATCHES = 4


class OddNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, WIDTH, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(WIDTH, WIDE, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(WIDE, WIDE, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(WIDE * (IMAGE_SIZE // 4) * (IMAGE_SIZE // 4), HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        return self.fc2(F.gelu(self.fc1(torch.flatten(x, 1))))


def make_data(generator):
    images = torch.randn(NUM_BATCHES, BATCH, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    # The label is the brightest (channel, image quadrant) pair: a pattern a
    # small CNN can pick up.
    half = IMAGE_SIZE // 2
    quadrants = images.view(NUM_BATCHES, BATCH, CHANNELS, 2, half, 2, half)
    energy = quadrants.mean(dim=(4, 6)).flatten(2)  # (NUM_BATCHES, BATCH, CHANNELS * 4)
    labels = energy.argmax(dim=-1) % NUM_CLASSES
    return images, labels


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
    images, labels = make_data(torch.Generator().manual_seed(args.seed))
    images, labels = images.to(device), labels.to(device)

    model = OddNet().to(device)
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
        loss = train_step(images[i], labels[i])
        print(f"step={step} loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
