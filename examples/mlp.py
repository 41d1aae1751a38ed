"""Train a small MLP on synthetic MNIST-shaped data.

    python examples/mlp.py --device cpu --steps 20
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from training import arguments, train

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
    args = arguments(__doc__).parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    x, y = make_data(torch.Generator().manual_seed(args.seed))
    x, y = x.to(device), y.to(device)

    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, optimizer, F.cross_entropy, lambda step: (x[step % NUM_BATCHES], y[step % NUM_BATCHES]), args)


if __name__ == "__main__":
    main()
