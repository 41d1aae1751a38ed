"""Train an MLP whose sizes are all one off the hardware-friendly ones.

Batch 127 and widths 1023 / 2047 leave TPU tiles (and CPU vector lanes) partly
empty; `tpu-agent` is meant to find and pad them (odd_shapes.py: convolutions).
Keep each size a plain integer literal: the tuner rewrites them on a copy.

    python examples/odd_mlp.py --device cpu --steps 20
"""

import torch
import torch.nn as nn

from training import arguments, train

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
    args = arguments(__doc__, lr=1e-4).parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    x, y = make_data(torch.Generator().manual_seed(args.seed))
    x, y = x.to(device), y.to(device)

    model = build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train(model, optimizer, nn.CrossEntropyLoss(), lambda step: (x[step % NUM_BATCHES], y[step % NUM_BATCHES]),
          args)


if __name__ == "__main__":
    main()
