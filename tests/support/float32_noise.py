"""How far float32 itself takes examples/fsdp2.py's training from the exact result: the per-parameter bound the
distributed tests hold a tpu run to against CPU gloo.

Two float32 runs of one training, summing in different orders, each land within float32's own error of the exact
(float64) result, so they differ by up to the sum of the two. AdamW makes that error large for a parameter where
a step's gradient nearly cancels: its first update is lr * g / (|g| + eps), whose slope at g = 0 is lr / eps
(1e6 with lr 1e-2, eps 1e-8), so float32's absolute rounding of such a gradient is multiplied by up to a million.
In fsdp2.py at 4 ranks, blocks.2.up.weight[78, 16]'s first gradient is 1.6e-8 (float64), 1.66e-8 in float32
(its summands are ~1e-3): the element ends 8.5e-5 off, and PyTorch's own CPU float32 run ends 1.26e-5 of the
parameter's norm from the float64 one; a tpu run summing in another order lands elsewhere in that range.

`errors(nproc)` computes, on the CPU in this process, the data-parallel training fsdp2.py does (each rank's batch,
the gradients averaged over the ranks, AdamW) in float32 and in float64: each parameter's float32 error relative
to its norm. tests/distributed/test_scripts.py checks that the device's own float32 error is no larger
than PyTorch's (so that twice PyTorch's bounds the distance between the two).
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


def train(nproc: int, steps: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    """fsdp2.py's training at world size `nproc` in one process: its model, data and AdamW, the ranks' gradients
    averaged (FSDP2's reduce-scatter of the mean); the final parameters in float64 on the CPU."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.Net().to(dtype).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    teacher = torch.randn(ex.WIDTH, ex.CLASSES, generator=torch.Generator().manual_seed(7))
    params = list(model.parameters())
    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(nproc):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(ex.BATCH, ex.WIDTH, generator=g)
            y = (x @ teacher).argmax(-1)
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
def errors(nproc: int, steps: int) -> dict[str, float]:
    """Each parameter's float32 error (PyTorch's CPU) from the float64 result, relative to its norm."""
    return relative(train(nproc, steps, torch.float32), train(nproc, steps, torch.float64))


def bounds(nproc: int, steps: int, floor: float) -> dict[str, float]:
    """Each parameter's bound on a float32 run's distance from PyTorch's CPU float32 run: twice PyTorch's own
    error from the exact result (both runs within it), and never below `floor`."""
    return {n: max(floor, 2 * e) for n, e in errors(nproc, steps).items()}
