"""Issue #28's drift case: a Llama with unaligned hidden, intermediate and vocabulary sizes, grouped-query
attention over one key/value head and a pad token trains on tpu with the CPU's losses, op by op, in the
device's default mode and as compiled steps, with the foreach and the fused AdamW.

The drift found was Adam's bias corrections in float32: `1 - beta2 ** 1` with float32(0.999) is 1.3e-5
off, so every early update was ~6e-6 off and the losses 2.5e-6 off by step 20, where eager's foreach
AdamW stays at 2e-7. Losses are held to 1e-5 as the other families are; the one-update test below is
the sharp check (it failed before the fix: 6e-6 against the 1e-6 it allows).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from support import hf_models  # noqa: E402

FAMILY = "llama_unaligned"
STEPS = 20


def _optimizer(model, fused: bool):
    return torch.optim.AdamW(model.parameters(), lr=hf_models.LR, fused=True) if fused else None


@contextlib.contextmanager
def _mode(mode: str, device: str):
    """`default` leaves the device's mode as the process started it (eager unless TORCH_TPU_DEFER_AND_FUSE)."""
    if device != "tpu" or mode == "default":
        yield
        return
    with hf_models.execution_mode(mode, device), hf_models._compiled_steps(mode, device):
        yield


def _losses(device: str, mode: str, fused: bool) -> list[float]:
    model, optimizer, inputs = hf_models.build(FAMILY, "sdpa", device)
    optimizer = _optimizer(model, fused) or optimizer
    losses = []
    with _mode(mode, device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(STEPS):
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


@functools.lru_cache(maxsize=None)
def _cpu_losses(fused: bool) -> tuple[float, ...]:
    return tuple(_losses("cpu", "eager", fused))


@pytest.mark.parametrize("mode,fused", [("eager", False), ("default", False), (hf_models.STEPS_MODE, False),
                                        ("eager", True)],
                         ids=["eager", "default", "compiled-steps", "eager-fused-adamw"])
def test_unaligned_gqa_llama_trains_like_cpu(mode, fused):
    expected = _cpu_losses(fused)
    actual = _losses("tpu", mode, fused)
    assert expected[-1] < expected[0] - 1, "the CPU run did not learn: the comparison would say little"
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert b == pytest.approx(a, rel=1e-5), f"step {step}: cpu {a} tpu {b} ({mode}, fused AdamW {fused})"


def _one_update(device: str, fused: bool, compiled: bool, grads: dict) -> dict:
    """The parameters' change in AdamW's first step from the same parameters and gradients."""
    model, optimizer, _ = hf_models.build(FAMILY, "sdpa", device)
    optimizer = _optimizer(model, fused) or optimizer
    before = {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = grads[name].to(device)
    with _mode(hf_models.STEPS_MODE if compiled else "eager", device):
        optimizer.step()
    return {n: p.detach().to("cpu") - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused,compiled", [(True, False), (False, True)], ids=["fused-adamw", "compiled-steps"])
def test_first_adamw_update_matches_cpu(fused, compiled):
    model, _, inputs = hf_models.build(FAMILY, "sdpa", "cpu")
    model(**inputs).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = _one_update("cpu", fused, False, grads)
    actual = _one_update("tpu", fused, compiled, grads)
    for name, delta in expected.items():
        error = ((actual[name] - delta).norm() / delta.norm()).item()
        assert error < 1e-6, f"{name}: update {error:.2e} relative from the CPU's"
