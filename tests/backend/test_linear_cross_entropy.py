"""F.linear_cross_entropy's chunked op with class-probability targets, which PyTorch 2.14 sends down the chunked
path (2.13 takes it for class indices only, so module_db on 2.13 never reaches it): the lowering's loss and
gradients against F.cross_entropy of the same logits on the CPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpu_agent.backend.core.jax_setup import device_x64
from tpu_agent.backend.ops import losses


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_probability_targets_match_cross_entropy_on_the_cpu(reduction, label_smoothing, weighted):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, generator=g, requires_grad=True)
    w = torch.randn(4, 5, generator=g, requires_grad=True)
    target = torch.softmax(torch.randn(8, 4, generator=g), -1)
    weight = torch.rand(4, generator=g) if weighted else None
    expected = F.cross_entropy(x @ w.T, target, weight=weight, reduction=reduction, label_smoothing=label_smoothing)
    expected.backward()

    def j(t):
        return None if t is None else jnp.asarray(t.detach().numpy())

    with device_x64():
        loss, grad_x, grad_w, grad_b = losses.linear_cross_entropy_batch_chunked(
            j(x), j(w), j(target), None, j(weight), reduction, -100, label_smoothing, 2, "auto", None, True,
            True, True, False)
    np.testing.assert_allclose(float(loss), expected.item(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_x), x.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_w), w.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert grad_b.shape == (0,)
