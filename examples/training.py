"""The training loop the single-device examples share (mlp, odd_shapes, odd_mlp, cnn, transformer).

Their command line (`--device`, default tpu; `--steps`, default 20; `--seed`, default 0; `--compile`; `--lr`
where the example takes one), and the loop: a step of `optimizer.zero_grad()`, the loss, `backward()` and
`optimizer.step()`, compiled as `--compile` asks, and one `step=<i> loss=<x.xxxxxx>` line a step. An example
imports it from its own folder (Python puts a script's folder first on `sys.path`), so `python examples/X.py`
runs from any working directory.
"""

import argparse

import torch


def arguments(doc: str, lr: float | None = None) -> argparse.ArgumentParser:
    """The flags every example takes (`lr`: the default of its `--lr`; None: it takes none); an example adds its
    own before parsing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    if lr is not None:
        parser.add_argument("--lr", type=float, default=lr)
    # Compile the training step into one program, or the model into forward and backward programs.
    parser.add_argument("--compile", choices=["none", "step", "model"], default="none")
    return parser


def train(model, optimizer, loss_fn, batch_of, args) -> None:
    """`args.steps` steps of `model`: `batch_of(step)` is the step's (inputs, targets) on the device and
    `loss_fn(outputs, targets)` its loss."""
    forward = torch.compile(model) if args.compile == "model" else model

    def train_step(inputs, targets):
        optimizer.zero_grad()
        loss = loss_fn(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    if args.compile == "step":
        train_step = torch.compile(train_step)

    model.train()
    for step in range(args.steps):
        loss = train_step(*batch_of(step))
        print(f"step={step} loss={loss.item():.6f}")
