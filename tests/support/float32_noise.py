"""How far float32 itself takes examples/fsdp2.py's training from the exact result: the per-parameter bound the
distributed tests hold a tpu run to against CPU gloo.

A float32 run of a training lands within float32's own error of the exact (float64) result; two float32 runs
that sum in different orders (the device and PyTorch's CPU kernels, gloo) differ by at most the sum of their two
errors. AdamW makes that error large for a parameter where a step's gradient nearly cancels: its first update
is lr * g / (|g| + eps), whose slope at g = 0 is lr / eps (1e6 with lr 1e-2, eps 1e-8), so float32's absolute
rounding of such a gradient is multiplied by up to a million. In fsdp2.py at 4 ranks, blocks.2.up.weight[78, 16]'s
first gradient is 1.6e-8 (float64), 1.66e-8 in float32 (its summands are ~1e-3): the element ends 8.5e-5 off, and
PyTorch's own CPU float32 run ends 1.26e-5 of the parameter's norm from the float64 one.

`bounds(nproc, steps, floor)`: for each parameter, PyTorch's own error (the gloo reference's: this process runs
the same math, and lands within 1e-7 of gloo) plus twice the largest error among float32 runs that sum in
`ORDERS` other orders (the ranks' gradients and each batch's rows permuted: the same mathematics); never below
`floor`. tests/distributed/test_scripts.py checks that the device's own float32 error stays within twice that
largest one.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from support.paths import EXAMPLES


def _example():
    spec = importlib.util.spec_from_file_location("fsdp2_example", EXAMPLES / "fsdp2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the script trains under `if __name__ == "__main__"` only
    return module


ORDERS = 8  # float32 runs in other summation orders: the spread of float32's error (2 ranks: 4.9e-6 to 1.0e-5)


def train(nproc: int, steps: int, dtype: torch.dtype, device: str = "cpu", order: int = 0) -> dict[str, torch.Tensor]:
    """fsdp2.py's training at world size `nproc` in one process: its model, data and AdamW, the ranks' gradients
    averaged (FSDP2's reduce-scatter of the mean); the final parameters in float64 on the CPU. `order` > 0 sums
    the same gradients in another order (ranks and each batch's rows permuted, seeded by `order`)."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.Net().to(dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    teacher = torch.randn(ex.WIDTH, ex.CLASSES, generator=torch.Generator().manual_seed(7))
    params = list(model.parameters())
    shuffle = torch.Generator().manual_seed(order)
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in (torch.randperm(nproc, generator=shuffle).tolist() if order else range(nproc)):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(ex.BATCH, ex.WIDTH, generator=g)
            y = (x @ teacher).argmax(-1)
            if order:
                rows = torch.randperm(ex.BATCH, generator=shuffle)
                x, y = x[rows], y[rows]
            logits = model(x.to(dtype).to(device))
            loss = F.cross_entropy(logits.float() if dtype == torch.float32 else logits, y.to(device))
            for t, grad in zip(total, torch.autograd.grad(loss, params)):
                t.add_(grad)
        for p, t in zip(params, total):
            p.grad = t / nproc
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().to("cpu", torch.float64) for name, p in model.named_parameters()}


def relative(run: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: ((run[n] - exact[n]).norm() / exact[n].norm()).item() for n in exact}


@functools.lru_cache(maxsize=None)
def errors(nproc: int, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each parameter's float32 error from the float64 result, relative to its norm: PyTorch's CPU run's, and
    the largest among ORDERS runs summing in other orders."""
    exact = train(nproc, steps, torch.float64)
    pytorch = relative(train(nproc, steps, torch.float32), exact)
    others = [relative(train(nproc, steps, torch.float32, order=k), exact) for k in range(1, ORDERS + 1)]
    return pytorch, {n: max(o[n] for o in others) for n in exact}


def bounds(nproc: int, steps: int, floor: float) -> dict[str, float]:
    """Each parameter's bound on a float32 run's distance from PyTorch's CPU float32 run (gloo): PyTorch's own
    error plus twice the largest of the other orders', never below `floor`."""
    pytorch, largest = errors(nproc, steps)
    return {n: max(floor, pytorch[n] + 2 * largest[n]) for n in pytorch}
