"""`F.scaled_dot_product_attention` on tpu is one op forward and one backward (the math path's dozen ops
are gone from the profile), agrees with PyTorch's CPU math path within 1e-5 in float32 for the variants
Hugging Face models use (causal, boolean and additive masks, fully masked rows, grouped-query heads,
scale, 3-D inputs, a mask that wants its gradient), draws dropout once and replays that mask in the
backward, and leaves the calls it does not cover, and their errors, to the math path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.dispatched import Ops

ATTENTION = torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default
ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward.default


def _run(device, tensors, **kwargs):
    leaves = [t.to(device).detach().requires_grad_(t.is_floating_point()) for t in tensors]
    q, k, v, *mask = leaves
    with Ops() as ops:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, **kwargs)
        (out * out).sum().backward()
    grads = [t.grad for t in leaves if t.requires_grad]
    return [x.detach().cpu().float() for x in (out, *grads)], ops.seen


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _qkv(b=2, hq=4, hkv=4, length=8, s=8, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((b, hq, length, d), (b, hkv, s, d), (b, hkv, s, d))]


def _full_row_mask():
    mask = torch.zeros(8, 8)
    mask[:, 5:] = float("-inf")
    mask[3, :] = float("-inf")  # a row that sees nothing: zeros, as the math path's _safe_softmax gives
    return mask


CASES = {
    "plain": (_qkv(), {}),
    "causal": (_qkv(), {"is_causal": True}),
    "causal, fewer queries than keys": (_qkv(length=5, s=9), {"is_causal": True}),
    "grouped-query heads": (_qkv(hq=8, hkv=2), {"is_causal": True, "enable_gqa": True}),
    "one key/value head": (_qkv(hq=4, hkv=1), {"enable_gqa": True}),
    "boolean mask": ([*_qkv(), torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.3], {}),
    "additive mask, a fully masked row": ([*_qkv(), _full_row_mask()], {}),
    "additive mask with its gradient": ([*_qkv(), torch.randn(1, 4, 8, 8)], {}),
    "scale": (_qkv(), {"scale": 0.3}),
    "3-d": ([t[0] for t in _qkv()], {"is_causal": True}),
}


@pytest.mark.parametrize("case", CASES)
def test_one_op_each_way_and_the_cpu_math_paths_values(case):
    tensors, kwargs = CASES[case]
    expected, _ = _run("cpu", tensors, **kwargs)
    got, seen = _run("tpu", tensors, **kwargs)
    assert seen.count(ATTENTION) == 1 and seen.count(ATTENTION_BACKWARD) == 1
    assert not {torch.ops.aten._softmax.default, torch.ops.aten._safe_softmax.default, torch.ops.aten.bmm.default} & set(seen)
    for name, a, b in zip(("out", "grad q", "grad k", "grad v", "grad mask"), got, expected):
        assert _rel(a, b) < 1e-5, (case, name, _rel(a, b))


def test_bfloat16_within_bfloat16s_reach_of_the_float32_result():
    tensors = _qkv(hq=8, hkv=2)
    reference, _ = _run("cpu", tensors, is_causal=True, enable_gqa=True)
    got, _ = _run("tpu", [t.bfloat16() for t in tensors], is_causal=True, enable_gqa=True)
    for a, b in zip(got, reference):
        assert _rel(a, b) < 2e-2


def _dropped(seed, q, k, v):
    torch.manual_seed(seed)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)


def test_dropout_draws_one_mask_and_the_backward_replays_it():
    q, k, _ = (t.to("tpu") for t in _qkv(s=6, d=6, length=6))
    identity = torch.eye(6).expand(2, 4, 6, 6).contiguous().to("tpu")
    probs = _dropped(7, q, k, identity).cpu()  # with v = I the output is the dropped probabilities
    kept = (probs > 0).float().mean().item()
    assert 0.45 < kept < 0.75, kept  # keep rate 0.6
    assert torch.equal(probs, _dropped(7, q, k, identity).cpu())  # a seed repeats it
    assert not torch.equal(probs, _dropped(8, q, k, identity).cpu())

    v = torch.randn(2, 4, 6, 6).to("tpu").requires_grad_()
    weights = torch.randn(2, 4, 6, 6)
    (_dropped(7, q, k, v) * weights.to("tpu")).sum().backward()
    assert torch.allclose(v.grad.cpu(), probs.transpose(-1, -2) @ weights, atol=1e-5)


def test_calls_it_does_not_cover_keep_the_math_path_and_its_errors():
    q, k, v = (t.to("tpu") for t in _qkv(hq=4, hkv=2))
    with pytest.raises(RuntimeError, match="must match the size"):  # GQA heads without enable_gqa
        F.scaled_dot_product_attention(q, k, v)
    q = q.double()
    with Ops() as ops:
        F.scaled_dot_product_attention(q, q, q)  # float64: not covered, still computed
    assert ATTENTION not in ops.seen and torch.ops.aten.bmm.default in ops.seen


def test_fused_mode_records_it_like_any_op():
    # Its int results (the sequence lengths) are shapes' facts: a recorded call gives them at once.
    tensors, kwargs = CASES["grouped-query heads"]
    expected, _ = _run("cpu", tensors, **kwargs)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        got, seen = _run("tpu", tensors, **kwargs)
    assert seen.count(ATTENTION) == 1 and seen.count(ATTENTION_BACKWARD) == 1
    for a, b in zip(got, expected):
        assert _rel(a, b) < 1e-5
