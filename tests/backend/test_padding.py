"""PadOps in the backend: matmuls and convolutions on padded shapes give the unpadded results and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from jax import lax

from tpu_agent.backend.core import padding


@pytest.fixture
def multiple():
    before = padding.multiple()
    yield padding.set_multiple
    padding.set_multiple(before)


def grads_of(fn, *tensors, device):
    leaves = [t.detach().to(device).requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(device)).sum().backward()
    return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]


@pytest.mark.parametrize("m", [8, 128])
@pytest.mark.parametrize("case", ["conv2d", "conv2d_strided", "linear"])
def test_padded_ops_match_unpadded(multiple, m, case):
    torch.manual_seed(0)
    if case == "linear":
        args = (torch.randn(50, 63), torch.randn(127, 63), torch.randn(127))
        fn = F.linear
    else:
        stride = 2 if case == "conv2d_strided" else 1
        args = (torch.randn(5, 3, 9, 9), torch.randn(63, 3, 3, 3), torch.randn(63))
        fn = lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=1)  # noqa: E731
    expected = grads_of(fn, *args, device="cpu")
    multiple(m)
    got = grads_of(fn, *args, device="tpu")
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_conv_runs_on_padded_channels(multiple):
    def run(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW"))

    x, w = jnp.ones((2, 63, 8, 8), jnp.float32), jnp.ones((127, 63, 3, 3), jnp.float32)
    multiple(8)
    text = str(jax.make_jaxpr(lambda a, b: padding.conv(a, b, run))(x, w))
    assert "f32[2,64,8,8]" in text and "f32[128,64,3,3]" in text  # padded operands
    assert padding.conv(x, w, run).shape == (2, 127, 8, 8)  # sliced back
    multiple(0)
    assert "f32[128,64,3,3]" not in str(jax.make_jaxpr(lambda a, b: padding.conv(a, b, run))(x, w))


def test_targeted_padding_pads_only_the_dims_of_the_target_sizes(multiple):
    a, b = jnp.ones((50, 64), jnp.float32), jnp.ones((64, 1001), jnp.float32)
    padding.set_multiple(256, (1001,))
    try:
        text = str(jax.make_jaxpr(padding.matmul)(a, b))
        assert "f32[64,1024]" in text and "f32[56," not in text  # N padded to 1024; M=50 left alone
        assert padding.matmul(a, b).shape == (50, 1001)
        assert padding.key() == (256, frozenset({1001}))
    finally:
        padding.set_multiple(0)


def test_the_env_var_takes_a_multiple_and_target_sizes():
    assert padding.parse("256:50257, 1000") == (256, frozenset({50257, 1000}))
    assert padding.parse("128") == (128, frozenset()) and padding.parse("") == (0, frozenset())
    with pytest.raises(ValueError, match="MULTIPLE:SIZE"):
        padding.parse("256:vocab")


def test_targeted_padding_of_an_lm_head_keeps_the_training_losses(multiple):
    """The LM head's vocabulary dim padded (exact): per-step losses as without padding."""

    def losses(targets):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(1001, 32), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 1001)).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 1001, (4, 16), generator=torch.Generator().manual_seed(1)).to("tpu")
        padding.set_multiple(*targets)
        out = []
        for _ in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            out.append(loss.item())
        padding.set_multiple(0)
        return out

    plain, padded = losses((0,)), losses((256, (1001,)))
    assert plain[-1] < plain[0]
    torch.testing.assert_close(padded, plain, rtol=1e-6, atol=0)
