"""Gradients on the tpu device match the CPU's, one test per op the examples use.

Each case builds its inputs and parameters on the CPU from a fixed seed, runs the
same scalar loss on CPU and on tpu, calls backward(), and compares every leaf's
gradient (rtol 1e-4, atol 1e-5). The loss weights the op's output by a fixed random
tensor, so every output element gets a distinct upstream gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

RTOL, ATOL = 1e-4, 1e-5


def _randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _weighted(out):
    """sum(out * w) with a fixed random w of out's shape (made on the CPU, moved alongside)."""
    w = _randn(*out.shape, seed=1234).to(out.device)
    return (out * w).sum()


# Each case: (leaves, loss). `leaves` maps names to CPU tensors that need gradients;
# `loss(t, device)` builds the scalar loss from them (t: the leaves on `device`).
CASES = {
    "linear": (
        lambda: {"x": _randn(4, 8), "w": _randn(5, 8, seed=1), "b": _randn(5, seed=2)},
        lambda t, d: _weighted(F.linear(t["x"], t["w"], t["b"])),
    ),
    "addmm": (
        lambda: {"c": _randn(4, 5), "a": _randn(4, 3, seed=1), "b": _randn(3, 5, seed=2)},
        lambda t, d: _weighted(torch.addmm(t["c"], t["a"], t["b"], beta=0.5, alpha=2.0)),
    ),
    "mm": (
        lambda: {"a": _randn(4, 3), "b": _randn(3, 6, seed=1)},
        lambda t, d: _weighted(torch.mm(t["a"], t["b"])),
    ),
    "bmm": (
        lambda: {"a": _randn(2, 4, 3), "b": _randn(2, 3, 5, seed=1)},
        lambda t, d: _weighted(torch.bmm(t["a"], t["b"])),
    ),
    "matmul": (
        lambda: {"a": _randn(2, 3, 4, 5), "b": _randn(5, 6, seed=1)},
        lambda t, d: _weighted(torch.matmul(t["a"], t["b"])),
    ),
    "relu": (lambda: {"x": _randn(6, 7)}, lambda t, d: _weighted(torch.relu(t["x"]))),
    "gelu": (lambda: {"x": _randn(6, 7)}, lambda t, d: _weighted(F.gelu(t["x"]))),
    "gelu_tanh": (lambda: {"x": _randn(6, 7)}, lambda t, d: _weighted(F.gelu(t["x"], approximate="tanh"))),
    "tanh": (lambda: {"x": _randn(6, 7)}, lambda t, d: _weighted(torch.tanh(t["x"]))),
    "softmax": (lambda: {"x": _randn(4, 9)}, lambda t, d: _weighted(torch.softmax(t["x"], dim=-1))),
    "log_softmax": (lambda: {"x": _randn(4, 9)}, lambda t, d: _weighted(F.log_softmax(t["x"], dim=1))),
    "cross_entropy": (
        lambda: {"x": _randn(6, 10)},
        lambda t, d: F.cross_entropy(t["x"], torch.tensor([1, 0, 9, 3, 3, 7]).to(d)),
    ),
    "cross_entropy_label_smoothing": (
        lambda: {"x": _randn(6, 10)},
        lambda t, d: F.cross_entropy(t["x"], torch.tensor([1, 0, 9, 3, 3, 7]).to(d), label_smoothing=0.1),
    ),
    "nll_loss": (
        lambda: {"x": _randn(5, 4)},
        lambda t, d: F.nll_loss(F.log_softmax(t["x"], dim=1), torch.tensor([0, 3, 1, 1, 2]).to(d)),
    ),
    "layer_norm": (
        lambda: {"x": _randn(3, 4, 8), "w": _randn(8, seed=1), "b": _randn(8, seed=2)},
        lambda t, d: _weighted(F.layer_norm(t["x"], (8,), t["w"], t["b"])),
    ),
    "embedding": (
        lambda: {"w": _randn(10, 4)},
        lambda t, d: _weighted(F.embedding(torch.tensor([[1, 2, 2], [9, 0, 1]]).to(d), t["w"])),
    ),
    "conv2d": (
        lambda: {"x": _randn(2, 3, 8, 8), "w": _randn(4, 3, 3, 3, seed=1), "b": _randn(4, seed=2)},
        lambda t, d: _weighted(F.conv2d(t["x"], t["w"], t["b"], stride=1, padding=1)),
    ),
    "conv2d_strided": (
        lambda: {"x": _randn(2, 4, 9, 9), "w": _randn(6, 2, 3, 3, seed=1)},
        lambda t, d: _weighted(F.conv2d(t["x"], t["w"], stride=2, padding=1, groups=2)),
    ),
    "batch_norm_train": (
        lambda: {"x": _randn(4, 3, 5, 5), "w": _randn(3, seed=1), "b": _randn(3, seed=2)},
        lambda t, d: _weighted(
            F.batch_norm(t["x"], torch.zeros(3).to(d), torch.ones(3).to(d), t["w"], t["b"], training=True)
        ),
    ),
    "max_pool2d": (
        lambda: {"x": _randn(2, 3, 8, 8)},
        lambda t, d: _weighted(F.max_pool2d(t["x"], kernel_size=2, stride=2)),
    ),
    "max_pool2d_overlapping": (
        lambda: {"x": _randn(2, 3, 9, 9)},
        lambda t, d: _weighted(F.max_pool2d(t["x"], kernel_size=3, stride=2, padding=1)),
    ),
    "dropout_p0": (
        lambda: {"x": _randn(5, 6)},
        lambda t, d: _weighted(F.dropout(t["x"], p=0.0, training=True)),
    ),
    "masked_fill": (
        lambda: {"x": _randn(4, 6)},
        lambda t, d: _weighted(t["x"].masked_fill((_randn(4, 6, seed=7) > 0).to(d), -3.0)),
    ),
    "transpose": (lambda: {"x": _randn(3, 4, 5)}, lambda t, d: _weighted(t["x"].transpose(0, 2) * 2)),
    "view": (lambda: {"x": _randn(3, 4, 5)}, lambda t, d: _weighted(t["x"].view(12, 5) * 2)),
    "reshape": (lambda: {"x": _randn(3, 4, 5)}, lambda t, d: _weighted(t["x"].transpose(0, 1).reshape(4, 15) * 2)),
    "slicing": (
        lambda: {"x": _randn(6, 8)},
        lambda t, d: _weighted(t["x"][1:5, ::2] * 3) + _weighted(t["x"][:, -1]) + _weighted(t["x"][2]),
    ),
    "sum": (lambda: {"x": _randn(4, 5, 6)}, lambda t, d: _weighted(t["x"].sum(dim=1)) + t["x"].sum()),
    "mean": (lambda: {"x": _randn(4, 5, 6)}, lambda t, d: _weighted(t["x"].mean(dim=(0, 2))) + t["x"].mean()),
    "mul": (lambda: {"a": _randn(4, 5), "b": _randn(5, seed=1)}, lambda t, d: _weighted(t["a"] * t["b"])),
    "add": (lambda: {"a": _randn(4, 5), "b": _randn(4, 1, seed=1)}, lambda t, d: _weighted(t["a"] + 2 * t["b"])),
    "sub": (lambda: {"a": _randn(4, 5), "b": _randn(5, seed=1)}, lambda t, d: _weighted(t["a"] - t["b"])),
    "div": (
        lambda: {"a": _randn(4, 5), "b": _randn(4, 5, seed=1).abs() + 0.5},
        lambda t, d: _weighted(t["a"] / t["b"]),
    ),
    "exp": (lambda: {"x": _randn(4, 5)}, lambda t, d: _weighted(torch.exp(t["x"]))),
    "log": (lambda: {"x": _randn(4, 5).abs() + 0.1}, lambda t, d: _weighted(torch.log(t["x"]))),
    "sqrt": (lambda: {"x": _randn(4, 5).abs() + 0.1}, lambda t, d: _weighted(torch.sqrt(t["x"]))),
    "rsqrt": (lambda: {"x": _randn(4, 5).abs() + 0.1}, lambda t, d: _weighted(torch.rsqrt(t["x"]))),
    "pow": (
        lambda: {"x": _randn(4, 5).abs() + 0.1},
        lambda t, d: _weighted(t["x"] ** 3) + _weighted(t["x"] ** 0.5) + _weighted(2.0 ** t["x"]),
    ),
    "pow_tensor_exponent": (
        lambda: {"x": _randn(4, 5).abs() + 0.1, "e": _randn(4, 5, seed=1)},
        lambda t, d: _weighted(torch.pow(t["x"], t["e"])),
    ),
}

def _grads(case, device):
    make, loss_fn = CASES[case]
    leaves = {k: v.to(device).requires_grad_(True) for k, v in make().items()}
    loss = loss_fn(leaves, device)
    loss.backward()
    return loss.detach().cpu(), {k: v.grad.cpu() for k, v in leaves.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_cpu(case):
    cpu_loss, cpu_grads = _grads(case, "cpu")
    tpu_loss, tpu_grads = _grads(case, "tpu")
    torch.testing.assert_close(tpu_loss, cpu_loss, rtol=RTOL, atol=ATOL)
    for name, expected in cpu_grads.items():
        torch.testing.assert_close(tpu_grads[name], expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("module", ["linear", "conv2d", "batch_norm", "batch_norm_eval", "layer_norm", "embedding"])
def test_module_parameter_gradients_match_cpu(module):
    """nn.Module parameters moved with .to('tpu') get the CPU's gradients."""

    def build():
        torch.manual_seed(0)
        return {
            "linear": (torch.nn.Linear(6, 4), lambda: _randn(3, 6)),
            "conv2d": (torch.nn.Conv2d(2, 3, 3, padding=1), lambda: _randn(2, 2, 6, 6)),
            "batch_norm": (torch.nn.BatchNorm2d(3), lambda: _randn(4, 3, 4, 4)),
            "batch_norm_eval": (torch.nn.BatchNorm2d(3), lambda: _randn(4, 3, 4, 4)),
            "layer_norm": (torch.nn.LayerNorm(6), lambda: _randn(3, 6)),
            "embedding": (torch.nn.Embedding(7, 4), lambda: torch.tensor([[0, 6, 2], [2, 2, 1]])),
        }[module]

    def run(device):
        m, make_input = build()
        m = m.to(device).train(module != "batch_norm_eval")
        out = m(make_input().to(device))
        _weighted(out).backward()
        return {n: p.grad.cpu() for n, p in m.named_parameters()}

    cpu, tpu = run("cpu"), run("tpu")
    assert cpu.keys() == tpu.keys()
    for name in cpu:
        torch.testing.assert_close(tpu[name], cpu[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"grad of {name}: {m}")
