"""The wrapper lives on `tpu:0` itself: tensors PyTorch's C++ code builds "on self's device"
carry data, the default device works, backward stays on the caller's thread, and running out
of device memory is PyTorch's own error."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F


def _cpu_and_tpu(fn, *tensors):
    expected = fn(*tensors)
    actual = fn(*[t.to("tpu") for t in tensors])
    return expected, actual


COMPOSITES = {
    "where_scalar": lambda x: torch.where(x > 0, x, 0.5),
    "masked_fill": lambda x: x.masked_fill(x > 0.3, -1.0),
    "clamp_tensor_min": lambda x: x.clamp(min=torch.tensor(0.1, device=x.device)),
    "cov": lambda x: torch.cov(x),
    "corrcoef": lambda x: torch.corrcoef(x),
    "cosine_similarity": lambda x: F.cosine_similarity(x, x.flip(0)),
    "quantile": lambda x: torch.quantile(x, 0.3, dim=1),
    "new_zeros_add": lambda x: x + x.new_zeros(x.shape[-1]),
    "new_full": lambda x: x.new_full((2,), 7.5) * x[0, :2],
    "sdpa_causal": lambda x: F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None], is_causal=True),
    "sdpa_bool_mask": lambda x: F.scaled_dot_product_attention(
        x[None, None], x[None, None], x[None, None],
        attn_mask=torch.ones(x.shape[0], x.shape[0], dtype=torch.bool, device=x.device).tril()),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composite_ops_that_build_tensors_on_self_device_match_cpu(name):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    expected, actual = _cpu_and_tpu(COMPOSITES[name], x)
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_pow_backward_with_a_tensor_exponent_matches_cpu():
    def grads(device):
        x = torch.tensor([0.5, 1.5, 2.0], device=device, requires_grad=True)
        e = torch.tensor([2.0, -1.0, 0.5], device=device, requires_grad=True)
        torch.pow(x, e).sum().backward()
        return x.grad.cpu(), e.grad.cpu()

    for a, b in zip(grads("cpu"), grads("tpu")):
        torch.testing.assert_close(b, a)


def test_default_device_tpu_gives_values():
    old = torch.get_default_device()
    torch.set_default_device("tpu")
    try:
        t = torch.tensor([1.5, -2.0, 3.0])
        r = torch.arange(5)
        f = torch.full((2, 3), 4.25)
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 4)
        z = torch.zeros(3, dtype=torch.long)
    finally:
        # Back to no default device at all: set_default_device(cpu) would leave a DeviceContext torch-function
        # mode on, and with one on PyTorch turns off nn.MultiheadAttention's and TransformerEncoderLayer's
        # fast paths for every later test of this worker (test_transformer_fast_path.py's CPU runs then took
        # the math path).
        torch.set_default_device(None if old == torch.device("cpu") else old)
    assert not torch._C._is_torch_function_mode_enabled()
    assert {t.device.type, r.device.type, f.device.type, lin.weight.device.type, z.device.type} == {"tpu"}
    assert t.cpu().tolist() == [1.5, -2.0, 3.0]
    assert r.cpu().tolist() == [0, 1, 2, 3, 4]
    assert f.cpu().eq(4.25).all()
    assert z.cpu().tolist() == [0, 0, 0]
    w = lin.weight.cpu()
    assert w.abs().max() <= 0.5 and w.abs().sum() > 0, "nn.Linear's init (kaiming uniform, bound 1/2) left no values"
    assert lin.bias.cpu().abs().max() <= 0.5


def test_tensor_constructor_with_device_keeps_data():
    t = torch.tensor([[1, 2], [3, 4]], device="tpu", dtype=torch.float32)
    assert t.cpu().tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert torch.as_tensor([5, 6], device="tpu").cpu().tolist() == [5, 6]


def test_backward_runs_on_the_callers_thread():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(threading.get_ident())
            return g * 2

    x = torch.ones(3, device="tpu", requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen == [threading.get_ident()]
    assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]


def test_out_of_device_memory_is_torch_out_of_memory_error_naming_op_and_bytes():
    x = torch.ones(1, device="tpu")
    with pytest.raises(torch.OutOfMemoryError) as info:
        (x.expand(2**38).contiguous() + 1).sum().item()  # 1 TiB of float32
    message = str(info.value)
    assert "out of device memory" in message and "aten." in message and "1.00 TiB" in message
    assert (x + 1).cpu().tolist() == [2.0], "the device is still usable after the error"
