"""Issue #28's drift case: a Llama with unaligned hidden, intermediate and vocabulary sizes, grouped-query
attention over one key/value head and a pad token trains on tpu with the CPU's losses, op by op, in the
device's default mode and as compiled steps, with the foreach and the fused AdamW.

Two causes were found. A compiled step differentiates the forward with JAX, and the embedding lookup's
JAX gradient reached the `padding_idx` row wherever a real token had the pad token's id (the batch
below has one): 1.2e-4 off the CPU's losses by step 15. And Adam's bias corrections were float32
(`1 - beta2 ** 1` with float32(0.999) is 1.3e-5 off): each early update ~6e-6 off, the losses 2.5e-6
by step 20. The one-update test is the sharp check of the second (6.6e-6 before the fix, 1e-6 allowed).
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


def _build(device: str, fused: bool):
    """The family's model and right-padded batch, one real token given the pad token's id (a tokenizer
    whose pad token is a word, or `pad_token = eos_token`): its embedding row learns on the CPU."""
    model, optimizer, inputs = hf_models.build(FAMILY, "sdpa", device)
    ids = inputs["input_ids"].clone()
    ids[0, 5] = model.config.pad_token_id
    inputs = {**inputs, "input_ids": ids, "labels": torch.where(inputs["labels"] == -100, -100, ids)}
    return model, _optimizer(model, fused) or optimizer, inputs


def _losses(device: str, mode: str, fused: bool) -> list[float]:
    model, optimizer, inputs = _build(device, fused)
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
    model, optimizer, _ = _build(device, fused)
    before = {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = grads[name].to(device)
    with _mode(hf_models.STEPS_MODE if compiled else "eager", device):
        optimizer.step()
    return {n: p.detach().to("cpu") - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused,compiled", [(True, False), (False, True)], ids=["fused-adamw", "compiled-steps"])
def test_first_adamw_update_matches_cpu(fused, compiled):
    model, _, inputs = _build("cpu", False)
    model(**inputs).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = _one_update("cpu", fused, False, grads)
    actual = _one_update("tpu", fused, compiled, grads)
    for name, delta in expected.items():
        error = ((actual[name] - delta).norm() / delta.norm()).item()
        assert error < 1e-6, f"{name}: update {error:.2e} relative from the CPU's"


@pytest.mark.parametrize("padding_idx,scale_grad_by_freq", [(0, False), (-1, True), (2, True)])
def test_embedding_lookup_differentiated_by_jax_gives_pytorchs_gradient(padding_idx, scale_grad_by_freq):
    """What a compiled step's backward is: JAX's gradient of the lookup's lowering, not embedding_dense_backward."""
    import jax
    import numpy as np

    from tpu_agent.backend.aten import dispatch  # noqa: F401 - fills the lowering table
    from tpu_agent.backend.core.registry import LOWERINGS

    weight = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 2, 2, 5], [2, 0, 1, 6]])
    grad_out = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))
    w = weight.clone().requires_grad_()
    torch.nn.functional.embedding(ids, w, padding_idx if padding_idx >= 0 else None,
                                  scale_grad_by_freq=scale_grad_by_freq).backward(grad_out)
    lookup = LOWERINGS[torch.ops.aten.embedding.default].fn
    rows, vjp = jax.vjp(lambda x: lookup(x, ids.numpy(), padding_idx, scale_grad_by_freq), weight.numpy())
    np.testing.assert_array_equal(np.asarray(rows), weight[ids].numpy())
    np.testing.assert_allclose(np.asarray(vjp(grad_out.numpy())[0]), w.grad.numpy(), rtol=1e-6, atol=1e-7)



# Issue #46's size: hidden 200, intermediate 3000 (a 3000-long reduction in the MLP's down projection), vocabulary
# 32001 (a 32001-way log-softmax), 5 query heads over 1 key/value head (head_dim 40), float32, AdamW. It was reported
# 1.35e-4 relative off the CPU's loss by step 15 in eager mode. Measured at this commit: 20 steps within 5e-7 of the
# CPU's losses in eager, fused and compiled-steps modes (this batch, HF's sdpa and eager attention, and
# benchmarks/unaligned_gqa_drift.py's 4 x 48 batch), no larger than the CPU's own float32 error: against a float64
# CPU run the first step's gradients are 1.1e-6 off on the CPU in float32 and 1.4e-6 on tpu (the worst parameter,
# the q projection's). Checked here, where it is cheap: three steps' losses, and every parameter's gradient of the
# first step (each op of the forward and backward at these sizes, before AdamW's sign-like first updates amplify
# rounding of near-zero gradients).
LARGE_STEPS = 3


def _large(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32001, hidden_size=200, intermediate_size=3000, num_hidden_layers=2,
                      num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    inputs = hf_models._right_padded(32001)
    ids = inputs["input_ids"].clone()
    ids[0, 5] = cfg.pad_token_id  # a real token with the pad token's id, as in _build
    inputs = {**inputs, "input_ids": ids, "labels": torch.where(inputs["labels"] == -100, -100, ids)}
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=hf_models.LR), {k: v.to(device) for k, v in inputs.items()}


def _large_run(device: str, mode: str) -> tuple[list[float], dict]:
    """Each step's loss, and the first step's gradients (read before its update)."""
    model, optimizer, inputs = _large(device)
    losses, grads = [], {}
    with _mode(mode, device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(LARGE_STEPS):
            loss = model(**inputs).loss
            loss.backward()
            if step == 0:
                grads = {n: p.grad.detach().to("cpu").clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, grads


@functools.lru_cache(maxsize=None)
def _large_cpu():
    return _large_run("cpu", "eager")


@pytest.mark.parametrize("mode", ["eager", "fused", hf_models.STEPS_MODE], ids=["eager", "fused", "compiled-steps"])
def test_issue_size_unaligned_gqa_llama_matches_cpu(mode):
    expected, expected_grads = _large_cpu()
    losses, grads = _large_run("tpu", mode)
    for step, (a, b) in enumerate(zip(expected, losses)):
        assert b == pytest.approx(a, rel=1e-5), f"step {step}: cpu {a} tpu {b} ({mode})"
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        error = ((grads[name] - grad).norm() / grad.norm()).item()
        assert error < 1e-5, f"{name}: the first step's gradient is {error:.2e} relative from the CPU's ({mode})"
