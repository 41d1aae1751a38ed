"""`F.scaled_dot_product_attention` on tpu runs as one op, forward and backward.

PyTorch picks a fused attention through a C++ dispatch stub a Python device cannot fill, so on tpu
it took the math path: a dozen ops, the attention matrix materialised twice. The op's autograd
kernel for PrivateUse1 sends it instead to `_scaled_dot_product_fused_attention_overrideable`, the
slot PyTorch keeps for such a device (its backward is PyTorch's own derivative entry), lowered in
ops/attention.py. Calls the one op does not cover keep the math path, and PyTorch's errors with it.
"""

from __future__ import annotations

import torch

_library: torch.library.Library | None = None


def _covered(query, key, value, attn_mask, is_causal, enable_gqa) -> bool:
    if query.dim() not in (3, 4) or key.dim() != query.dim() or value.dim() != query.dim():
        return False
    if query.is_nested or query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or key.shape[-3] != value.shape[-3]:
        return False
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-2] != value.shape[:-2] or query.shape[-1] != key.shape[-1]:
        return False
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return False
    if attn_mask is not None:
        if is_causal or attn_mask.dim() > 4 or attn_mask.dtype not in (torch.bool, query.dtype):
            return False
        try:
            torch.broadcast_shapes(attn_mask.shape, (*query.shape[:-1], key.shape[-2]))
        except RuntimeError:
            return False
    return True


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not _covered(query, key, value, attn_mask, is_causal, enable_gqa):
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    if attn_mask is not None and attn_mask.dim() < 4 and query.dim() == 4:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    return torch.ops.aten._scaled_dot_product_fused_attention_overrideable(
        query, key, value, attn_mask, dropout_p, is_causal, False, scale=scale)[0]


def register() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
