"""Train a small CNN on synthetic 3x32x32 (CIFAR-shaped) images.

    python examples/cnn.py --device cpu --steps 20
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from training import arguments, train

BATCH = 32
CHANNELS = 3
IMAGE_SIZE = 32
NUM_CLASSES = 10
NUM_BATCHES = 8


class SmallCNN(nn.Module):
    def __init__(self, dropout=0.25):
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, 16, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(32 * (IMAGE_SIZE // 4) * (IMAGE_SIZE // 4), NUM_CLASSES)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = self.dropout(torch.flatten(x, 1))
        return self.fc(x)


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
    parser = arguments(__doc__)
    # Dropout masks come from each device's own RNG stream (as on CUDA): compare
    # devices step by step with --dropout 0.
    parser.add_argument("--dropout", type=float, default=0.25)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    images, labels = make_data(torch.Generator().manual_seed(args.seed))
    images, labels = images.to(device), labels.to(device)

    model = SmallCNN(args.dropout).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    train(model, optimizer, F.cross_entropy,
          lambda step: (images[step % NUM_BATCHES], labels[step % NUM_BATCHES]), args)


if __name__ == "__main__":
    main()
