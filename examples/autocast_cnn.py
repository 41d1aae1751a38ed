"""Train a small CNN in bfloat16 autocast with a pinned DataLoader, checkpoints and resume, as users write it.

The device is whatever accelerator PyTorch reports (tpu under `tpu-agent run`), else the CPU:

    python examples/autocast_cnn.py --steps 12 --save-every 6 --checkpoint ckpt.pt
    python examples/autocast_cnn.py --steps 12 --checkpoint ckpt.pt --resume
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

BATCH = 16
IMAGE_SIZE = 16
NUM_CLASSES = 10
SAMPLES = 256


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * (IMAGE_SIZE // 4) ** 2, NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="autocast_cnn.pt")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = parser.parse_args()

    device = torch.accelerator.current_accelerator() or torch.device("cpu")
    print(f"device={device.type}")
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    images = torch.randn(SAMPLES, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (SAMPLES,), generator=g)
    # shuffle=False: the resumed run sees the same batches as an uninterrupted one
    loader = DataLoader(TensorDataset(images, labels), batch_size=BATCH, shuffle=False, pin_memory=True,
                        drop_last=True)

    model = ConvNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # bf16 needs no loss scaling; fp16 would
    start = 0
    if args.resume:
        state = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    step = 0
    while step < args.steps:
        for x, y in loader:
            step += 1
            if step > args.steps:
                break
            if step <= start:  # done before the checkpoint: the same batches, skipped
                continue
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            print(f"step={step} loss={loss.item():.6f} dtype={logits.dtype}")
            if args.save_every and step % args.save_every == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                           args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)


if __name__ == "__main__":
    main()
