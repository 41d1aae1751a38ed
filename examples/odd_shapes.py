"""Train a small CNN whose sizes are all one off the hardware-friendly ones.

Batch 50, channel counts 63 and 127 and a 255-wide hidden layer leave TPU
tiles (and CPU vector lanes) partly empty; `tpu-agent` is meant to find and
pad them. Keep each size a plain integer literal: the tuner rewrites these
literals on a copy.

    python examples/odd_shapes.py --device cpu --steps 20
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from training import arguments, train

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
    args = arguments(__doc__, lr=1e-4).parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    images, labels = make_data(torch.Generator().manual_seed(args.seed))
    images, labels = images.to(device), labels.to(device)

    model = OddNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train(model, optimizer, nn.CrossEntropyLoss(),
          lambda step: (images[step % NUM_BATCHES], labels[step % NUM_BATCHES]), args)


if __name__ == "__main__":
    main()
