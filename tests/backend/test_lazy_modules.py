"""Lazy modules moved to tpu before their first forward materialize there: the first forward infers the shapes,
initializes the parameters with the CPU's generator (the values a CPU run seeded alike gets) and leaves them on
tpu as ordinary parameters; outputs, gradients and a training step match the CPU's."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

LAZY = {
    "LazyLinear": (lambda: nn.LazyLinear(4), (3, 5)),
    "LazyConv1d": (lambda: nn.LazyConv1d(4, 3), (2, 3, 9)),
    "LazyConv2d": (lambda: nn.LazyConv2d(4, 3, padding=1), (2, 3, 6, 6)),
    "LazyConv3d": (lambda: nn.LazyConv3d(2, 2), (2, 3, 4, 4, 4)),
    "LazyConvTranspose1d": (lambda: nn.LazyConvTranspose1d(4, 3), (2, 3, 5)),
    "LazyConvTranspose2d": (lambda: nn.LazyConvTranspose2d(4, 3, stride=2), (2, 3, 4, 4)),
    "LazyConvTranspose3d": (lambda: nn.LazyConvTranspose3d(2, 2), (2, 3, 3, 3, 3)),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), (6, 3)),
    "LazyBatchNorm2d": (lambda: nn.LazyBatchNorm2d(), (4, 3, 5, 5)),
    "LazyBatchNorm3d": (lambda: nn.LazyBatchNorm3d(), (2, 3, 3, 3, 3)),
    "LazyInstanceNorm2d": (lambda: nn.LazyInstanceNorm2d(affine=True, track_running_stats=True), (4, 3, 5, 5)),
}


def _run(name: str, device: str, move: str = "to"):
    make, shape = LAZY[name]
    torch.manual_seed(0)
    module = make()
    if device == "tpu":
        module = module.to("tpu") if move == "to" else module.tpu()
    torch.manual_seed(1)  # the initialization's draws
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    out = module(x)
    # A random cotangent: with out.sum() a normalization's gradients would be sums that cancel to rounding.
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(device))
    return module, out.detach().cpu(), x.grad.cpu()


@pytest.mark.parametrize("name", list(LAZY))
def test_a_lazy_module_moved_to_tpu_materializes_there_as_on_the_cpu(name):
    cpu, cpu_out, cpu_grad = _run(name, "cpu")
    tpu, out, grad = _run(name, "tpu")
    assert type(tpu) is type(cpu) and not type(tpu).__name__.startswith("Lazy")
    torch.testing.assert_close(out, cpu_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, cpu_grad, rtol=1e-5, atol=1e-5)
    cpu_state, tpu_state = cpu.state_dict(), tpu.state_dict()
    assert tpu_state.keys() == cpu_state.keys()
    for key, value in cpu_state.items():
        assert tpu_state[key].device.type == "tpu", key
        torch.testing.assert_close(tpu_state[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for (key, p), (_, q) in zip(tpu.named_parameters(), cpu.named_parameters()):
        assert isinstance(p, nn.Parameter) and p.requires_grad, key
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_module_tpu_and_a_model_of_lazy_layers_train_as_on_the_cpu():
    def train(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyConv2d(6, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
        model = model.tpu() if device == "tpu" else model
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(4, 2, 7, 7, generator=g), torch.randint(0, 3, (4,), generator=g)
        model(x.to(device))  # materialize, then build the optimizer over the real parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.cpu() for k, v in model.state_dict().items()}

    cpu_losses, cpu_state = train("cpu")
    losses, state = train("tpu")
    assert losses == pytest.approx(cpu_losses, rel=1e-5)
    for key, value in cpu_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_a_lazy_module_on_tpu_loads_a_state_dict():
    source = nn.Linear(5, 4)
    lazy = nn.LazyLinear(4).to("tpu")
    lazy.load_state_dict(source.state_dict())
    assert lazy.weight.device.type == "tpu" and lazy.weight.shape == (4, 5)
    x = torch.randn(3, 5)
    torch.testing.assert_close(lazy(x.to("tpu")).detach().cpu(), source(x).detach())


def test_a_lazy_module_moved_to_tpu_in_double_materializes_in_double():
    lazy = nn.LazyLinear(2).to("tpu", torch.float64)
    out = lazy(torch.randn(3, 4, dtype=torch.float64).to("tpu"))
    assert lazy.weight.dtype == torch.float64 and lazy.weight.device.type == "tpu" and out.dtype == torch.float64


@pytest.mark.parametrize("how", ["fused", "torch.compile"])
def test_lazy_modules_in_fused_mode_and_under_torch_compile(how):
    """torch.compile of a model whose lazy layers have no shapes yet: as PyTorch's own compile does, their first
    forward runs as written (it materializes them), and the module is compiled from the next call."""

    def run(device):
        torch.manual_seed(0)
        model = nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.Flatten(), nn.LazyLinear(3)).to(device)
        call = torch.compile(model) if device == "tpu" and how == "torch.compile" else model
        g = torch.Generator().manual_seed(1)
        fused = device == "tpu" and how == "fused"
        mode = torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if fused else contextlib.nullcontext()
        with mode:
            outs = [call(torch.randn(2, 3, 6, 6, generator=g).to(device)).detach().cpu() for _ in range(4)]
        return outs, {k: v.cpu() for k, v in model.state_dict().items()}, call

    cpu_outs, cpu_state, _ = run("cpu")
    outs, state, call = run("tpu")
    for a, e in zip(outs, cpu_outs):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    for key, value in cpu_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    if how == "torch.compile":
        assert call.reason_not_compiled is None and call.replays >= 1
