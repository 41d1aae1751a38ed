"""Gradient clipping on the tpu device takes PyTorch's multi-tensor (foreach) path, as on CUDA: a fixed number of
ops per call whatever the number of gradients (a host cost per step that does not grow with the model), with the
CPU's total norm and clipped gradients."""

from __future__ import annotations

import pytest
import torch

from tpu_agent.backend.core import executables


def _grads(n: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    params = []
    for i in range(n):
        p = torch.nn.Parameter(torch.zeros(3 + i % 4, 5).to(device))
        p.grad = torch.randn(3 + i % 4, 5, generator=g).to(device) * (1 + i)
        params.append(p)
    return params


def _launches() -> int:
    return sum(e.calls for e in executables.all())


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_matches_the_cpu(norm_type):
    cpu, tpu = _grads(7, "cpu"), _grads(7, "tpu")
    want = torch.nn.utils.clip_grad_norm_(cpu, 1.5, norm_type=norm_type)
    got = torch.nn.utils.clip_grad_norm_(tpu, 1.5, norm_type=norm_type)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    for c, t in zip(cpu, tpu):
        torch.testing.assert_close(t.grad.cpu(), c.grad, rtol=1e-6, atol=1e-6)


def test_clip_grad_value_matches_the_cpu():
    cpu, tpu = _grads(5, "cpu"), _grads(5, "tpu")
    torch.nn.utils.clip_grad_value_(cpu, 0.7)
    torch.nn.utils.clip_grad_value_(tpu, 0.7)
    for c, t in zip(cpu, tpu):
        torch.testing.assert_close(t.grad.cpu(), c.grad)


def test_clip_grad_norm_launches_do_not_grow_with_the_gradients():
    counts = []
    for n in (4, 16):
        params = _grads(n, "tpu")
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # compiles its programs
        params = _grads(n, "tpu")
        before = _launches()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        counts.append(_launches() - before)
    assert counts[0] == counts[1], counts  # per-gradient ops would launch 2 per gradient: 8 and 32
