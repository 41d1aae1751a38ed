"""Fused Adam / AdamW on tpu (transformers' default optimizer is adamw_torch_fused) match
PyTorch's CPU fused kernels, GradScaler's unscale-and-skip path included."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn


def _train(device, cls, steps=4, scaler_inf_step=None, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    if isinstance(kwargs.get("lr"), torch.Tensor):
        kwargs["lr"] = kwargs["lr"].clone()
    opt = cls(model.parameters(), fused=True, **kwargs)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10) if scaler_inf_step is not None else None
    x, y = torch.randn(8, 4).to(device), torch.randn(8, 2).to(device)
    losses, snapshots = [], []
    for step in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step == scaler_inf_step:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
        snapshots.append([p.detach().cpu().clone() for p in model.parameters()])
    return losses, snapshots, opt


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("options", [{"weight_decay": 0.1}, {"amsgrad": True, "weight_decay": 0.01},
                                     {"maximize": True}, {"lr": torch.tensor(0.01)}], ids=str)
def test_fused_adam_matches_the_cpu_fused_kernel(cls, options):
    options = {"lr": 0.01, **options}
    cpu_losses, cpu_params, _ = _train("cpu", cls, **options)
    tpu_losses, tpu_params, opt = _train("tpu", cls, **options)
    assert tpu_losses == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    for a, b in zip(cpu_params[-1], tpu_params[-1]):
        assert torch.allclose(a, b, atol=1e-6)
    state = opt.state[next(iter(opt.state))]
    assert state["exp_avg"].device.type == "tpu" and state["step"].item() == 4


def test_fused_adamw_with_grad_scaler_skips_the_overflow_step_as_on_cpu():
    cpu_losses, cpu_params, _ = _train("cpu", torch.optim.AdamW, scaler_inf_step=1, lr=0.01)
    tpu_losses, tpu_params, _ = _train("tpu", torch.optim.AdamW, scaler_inf_step=1, lr=0.01)
    assert all(torch.equal(a, b) for a, b in zip(tpu_params[1], tpu_params[0])), "step 1 overflowed: skipped"
    assert not torch.equal(tpu_params[2][0], tpu_params[1][0])
    assert tpu_losses == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    for a, b in zip(cpu_params[-1], tpu_params[-1]):
        assert torch.allclose(a, b, atol=1e-6)
