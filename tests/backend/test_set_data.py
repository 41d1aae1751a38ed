"""`tensor.data = other` on tpu does what it does on the CPU: the tensor takes the other's values, shape and dtype
(it kept its old values, silently), old `.data` aliases keep the old values, a view's storage is shared, and a
model whose weights were set so trains as on the CPU."""

from __future__ import annotations

import pytest
import torch


def _both(fn):
    return fn("cpu"), fn("tpu")


def test_set_data_takes_the_values_shape_and_dtype():
    def run(device):
        p = torch.nn.Parameter(torch.ones(3, device=device))
        old = p.data
        p.data = torch.arange(5.0, device=device)
        q = torch.nn.Parameter(torch.ones(2, 2, device=device))
        q.data = q.data.double() * 3
        return p.detach().cpu(), old.cpu(), q.detach().cpu(), p.requires_grad, isinstance(p, torch.nn.Parameter)

    cpu, tpu = _both(run)
    for c, t in zip(cpu, tpu):
        if isinstance(c, torch.Tensor):
            assert c.dtype == t.dtype
            torch.testing.assert_close(t, c, rtol=0, atol=0)
        else:
            assert c == t


def test_set_data_to_a_view_shares_its_storage():
    def run(device):
        base = torch.arange(6.0, device=device).view(2, 3)
        w = torch.ones(4, device=device)
        w.data = base[1]
        base.add_(1)
        return w.cpu()

    cpu, tpu = _both(run)
    torch.testing.assert_close(tpu, cpu, rtol=0, atol=0)


def test_weights_set_through_data_train_as_on_the_cpu():
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device)
        g = torch.Generator().manual_seed(1)
        for m in model:
            if isinstance(m, torch.nn.Linear):  # an init as HF models and user code write it
                m.weight.data = (torch.randn(m.weight.shape, generator=g) * 0.02).to(device)
                m.bias.data.zero_()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(5, 8, generator=g).to(device)
        losses = []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    (cpu_losses, cpu_params), (tpu_losses, tpu_params) = _both(run)
    assert tpu_losses == pytest.approx(cpu_losses, rel=1e-5)
    for c, t in zip(cpu_params, tpu_params):
        torch.testing.assert_close(t, c, rtol=1e-5, atol=1e-6)


def test_set_data_to_a_cpu_tensor_is_refused_in_one_line():
    p = torch.nn.Parameter(torch.ones(3, device="tpu"))
    with pytest.raises(RuntimeError, match=r"set to a tensor on cpu: move it first"):
        p.data = torch.zeros(3)
    torch.testing.assert_close(p.detach().cpu(), torch.ones(3))
