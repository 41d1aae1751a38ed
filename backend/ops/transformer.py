"""The Transformer fast path PyTorch takes on a PrivateUse1 device in eval mode under no_grad:
`_native_multi_head_attention` (nn.MultiheadAttention) and `_transformer_encoder_layer_fwd`
(nn.TransformerEncoderLayer), each one program, with the CPU kernels' semantics:

- the query is scaled by 1/sqrt(head dim) after its bias is added, before the scores;
- a mask is read as a boolean, True masking out (a float mask from `F._canonical_mask` is -inf where masked:
  any nonzero value masks, as the CPU kernel's conversion does); mask type 0 is [L, S], 1 a key padding
  mask [B, S], 2 anything broadcastable to [B, H, L, S]; a row that sees no key gives NaN, as the
  CPU kernel does;
- the attention weights come back only when asked, averaged over heads when asked.

Nested tensors cannot live on a Python device: backend/nn/transformer.py makes nn.TransformerEncoder give the
nested path's result without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from ..core.registry import lower

aten = torch.ops.aten


def _masked_softmax(scores, mask, mask_type):
    if mask is not None:
        masked = mask if mask.dtype == jnp.bool_ else mask != 0
        b, _, length, s = scores.shape
        if masked.ndim == 2 and mask_type == 1:
            masked = masked.reshape(b, 1, 1, s)
        elif masked.ndim == 2:
            masked = masked.reshape(1, 1, length, s)
        scores = jnp.where(masked, -jnp.inf, scores)
    # a row that sees no key: -inf - -inf, NaN, as on the CPU
    exp = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    return exp / jnp.sum(exp, axis=-1, keepdims=True)


def _heads(x, num_head):
    b, t, d = x.shape
    return x.reshape(b, t, num_head, d // num_head).transpose(0, 2, 1, 3)


def multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                         mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    d = embed_dim
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
        raise RuntimeError(f"expected 3-D `query`, `key` and `value`, got {query.ndim}-D, {key.ndim}-D, "
                           f"{value.ndim}-D tensors")
    if query.shape[2] != d:
        raise RuntimeError(f"passed-in embed_dim {d} didn't match last dim of query {query.shape[2]}")
    if not query.shape == key.shape == value.shape:
        raise RuntimeError("expected `query`/`key`/`value` shapes to match")
    if qkv_weight.shape != (3 * d, d) or qkv_bias.shape != (3 * d,):
        raise RuntimeError(f"expected `qkv_weight` of shape [{3 * d}, {d}] and `qkv_bias` of [{3 * d}]")
    if d % num_head:
        raise RuntimeError("`embed_dim` must divide evenly by `num_heads`")
    w_q, w_k, w_v = jnp.split(qkv_weight, 3)
    b_q, b_k, b_v = jnp.split(qkv_bias, 3)
    scale = jnp.asarray(1.0 / (d // num_head) ** 0.5, query.dtype)
    q = _heads((query @ w_q.T + b_q) * scale, num_head)
    k = _heads(key @ w_k.T + b_k, num_head)
    v = _heads(value @ w_v.T + b_v, num_head)
    weights = _masked_softmax(jnp.einsum("bhtd,bhsd->bhts", q, k), mask, mask_type)
    context = jnp.einsum("bhts,bhsd->bhtd", weights, v)
    b, _, t, _ = context.shape
    out = context.transpose(0, 2, 1, 3).reshape(b, t, d) @ proj_weight.T + proj_bias
    if not need_weights:
        return out, None
    if average_attn_weights:
        weights = jnp.sum(weights, axis=1) / num_head
    return out, weights


@lower(aten._native_multi_head_attention.default, meta_check=False)
def native_multi_head_attention(*args, **kwargs):
    return multi_head_attention(*args, **kwargs)  # weights not asked for: None, PyTorch's undefined tensor


def _layer_norm(x, weight, bias, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * weight + bias


@lower(aten._transformer_encoder_layer_fwd.default, static_floats=True)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                                  ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    x = _layer_norm(src, norm_weight_1, norm_bias_1, eps) if norm_first else src
    x = multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                             False, True, mask_type)[0] + src
    if not norm_first:
        x = _layer_norm(x, norm_weight_1, norm_bias_1, eps)
    residual = x
    if norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    hidden = x @ ffn_weight_1.T + ffn_bias_1
    hidden = jax.nn.gelu(hidden, approximate=False) if use_gelu else jax.nn.relu(hidden)
    x = hidden @ ffn_weight_2.T + ffn_bias_2 + residual
    if not norm_first:
        x = _layer_norm(x, norm_weight_2, norm_bias_2, eps)
    return x
