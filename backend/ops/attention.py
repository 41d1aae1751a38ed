"""Attention as one op: `_scaled_dot_product_fused_attention_overrideable`, PyTorch's slot for a
PrivateUse1 device's fused attention, and its backward.

One lowering, not the math path's dozen ops, so a profile shows attention as attention and XLA sees
the whole of it (an accelerator's compiler can pick its fused kernel). Grouped-query attention is
computed on the grouped heads, never on key/value copies. Fully masked rows give zeros, as the math
path's `_safe_softmax` does. Dropout draws its mask from the device's RNG; the key travels to the
backward in `philox_seed` (its two 32-bit words as one int64), so the backward redraws the same mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core.registry import lower

aten = torch.ops.aten


def _grouped(q, k):
    """q [B, Hq, L, D] as [B, Hkv, G, L, D]: G query heads share each key/value head."""
    b, hq, length, d = q.shape
    hkv = k.shape[1]
    return q.reshape(b, hkv, hq // hkv, length, d)


def _bias_grouped(bias, hq, hkv):
    """A mask broadcastable to [B, Hq, L, S], as [B|1, Hkv|1, G|1, L|1, S|1]."""
    bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    b, h, length, s = bias.shape
    if h == 1:
        return bias.reshape(b, 1, 1, length, s)
    return bias.reshape(b, hkv, hq // hkv, length, s)


def _probabilities(q, k, bias, is_causal, scale):
    """Softmax of the scaled, masked scores in float32 (at least), and the rows' logsumexp."""
    hq, hkv = q.shape[1], k.shape[1]
    work = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("bhgld,bhsd->bhgls", _grouped(q, k), k, preferred_element_type=work) * scale
    length, s = scores.shape[-2:]
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((length, s), jnp.bool_)), scores, -jnp.inf)
    if bias is not None:
        bias = _bias_grouped(bias, hq, hkv)
        scores = jnp.where(bias, scores, -jnp.inf) if bias.dtype == jnp.bool_ else scores + bias.astype(work)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    exp = jnp.exp(scores - top)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    probs = jnp.where(total > 0, exp / jnp.where(total > 0, total, 1.0), 0.0)  # a fully masked row: zeros
    lse = jnp.log(total) + top  # -inf for a fully masked row
    return probs, lse[..., 0]


def _dropped(probs, p, key):
    keep = jax.random.bernoulli(key, 1.0 - p, probs.shape)
    return jnp.where(keep, probs / (1.0 - p), 0.0)


def _attend(q, k, v, bias, p, is_causal, scale, key):
    probs, lse = _probabilities(q, k, bias, is_causal, scale)
    if p > 0:
        probs = _dropped(probs, p, key)
    out = jnp.einsum("bhgls,bhsd->bhgld", probs.astype(v.dtype) if v.dtype != probs.dtype else probs, v,
                     preferred_element_type=probs.dtype)
    b, hq, length = q.shape[0], q.shape[1], q.shape[2]
    return out.reshape(b, hq, length, v.shape[-1]).astype(q.dtype), lse.reshape(b, hq, length)


def _four_d(x):
    return x if x is None or x.ndim == 4 else x[None]


def _scale(q, scale):
    return scale if scale is not None else 1.0 / float(q.shape[-1]) ** 0.5


def _seed(key):
    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return jax.lax.bitcast_convert_type(words.astype(jnp.uint32), jnp.int64)


def _key(seed):
    return jax.lax.bitcast_convert_type(seed, jnp.uint32)


@lower(aten._scaled_dot_product_fused_attention_overrideable.default, static_floats=True, random=True)
def attention(query, keys, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, /, *,
              scale=None, key):
    # positional-only: the op's own `key` argument arrives by position, the RNG's key by keyword
    prng = key
    three_d = query.ndim == 3
    q, k, v = _four_d(query), _four_d(keys), _four_d(value)
    out, lse = _attend(q, k, v, attn_bias, dropout_p, is_causal, _scale(q, scale), prng)
    if three_d:
        out = out[0]
    seed = _seed(prng) if dropout_p > 0 else jnp.zeros((), jnp.int64)
    return out, lse, None, None, q.shape[2], k.shape[2], seed, jnp.zeros((), jnp.int64), None


@lower(aten._scaled_dot_product_fused_attention_overrideable_backward.default, static_floats=True)
def attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k,
                       max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    three_d = query.ndim == 3
    q, k, v, g = _four_d(query), _four_d(key), _four_d(value), _four_d(grad_out)
    prng = _key(philox_seed)
    float_bias = attn_bias is not None and attn_bias.dtype != jnp.bool_

    def forward(q, k, v, bias):
        return _attend(q, k, v, bias if float_bias else attn_bias, dropout_p, is_causal, _scale(q, scale), prng)[0]

    _, pullback = jax.vjp(forward, q, k, v, attn_bias if float_bias else jnp.zeros((), q.dtype))
    dq, dk, dv, dbias = pullback(g)
    if three_d:
        dq, dk, dv = dq[0], dk[0], dv[0]
    if attn_bias is None:
        dbias = None
    elif not float_bias or not grad_input_mask[3]:
        dbias = jnp.zeros(attn_bias.shape, attn_bias.dtype)
    return dq, dk, dv, dbias


def _packed_mask(cum_seq_q, cum_seq_k, total_q, total_k, left, right):
    """[Tq, Tk] True where a query may see a key: the same packed sequence, inside the window (flash
    attention's bottom-right alignment when a sequence's query and key lengths differ; -1 is unbounded)."""
    iq, ik = jnp.arange(total_q), jnp.arange(total_k)
    seq_q = jnp.searchsorted(cum_seq_q[1:], iq, side="right")
    seq_k = jnp.searchsorted(cum_seq_k[1:], ik, side="right")
    pos_q = iq - cum_seq_q[seq_q]
    # The key position a query lines up with: its own plus (key length - query length) of its sequence.
    shift = (cum_seq_k[seq_q + 1] - cum_seq_k[seq_q]) - (cum_seq_q[seq_q + 1] - cum_seq_q[seq_q])
    diag = (pos_q + shift)[:, None]
    pos_k = (ik - cum_seq_k[seq_k])[None, :]
    mask = seq_q[:, None] == seq_k[None, :]
    if right >= 0:
        mask &= pos_k <= diag + right
    if left >= 0:
        mask &= pos_k >= diag - left
    return mask


def _varlen(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale, left, right):
    """Packed [T, N, H] attention as one batch of T: out [Tq, N, Hv] and logsumexp [N, Tq]."""
    left = -1 if left is None else left
    right = 0 if is_causal else (-1 if right is None else right)
    mask = _packed_mask(cum_seq_q, cum_seq_k, q.shape[0], k.shape[0], left, right)
    q4, k4, v4 = (x.transpose(1, 0, 2)[None] for x in (q, k, v))
    out, lse = _attend(q4, k4, v4, mask, 0.0, False, _scale(q4, scale), None)
    return out[0].transpose(1, 0, 2), lse[0]


@lower(aten._flash_attention_forward.default, static_floats=True)
def flash_attention_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                           seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """Flash attention's packed form (`torch.nn.attention.varlen_attn`, TorchTitan's varlen backend): sequences
    of any lengths side by side in [T, N, H], bounded by the cumulative lengths `cum_seq_q`/`cum_seq_k`."""
    if cum_seq_q is None or dropout_p > 0 or return_debug_mask or seqused_k is not None \
            or alibi_slopes is not None or block_table is not None:
        raise NotImplementedError("_flash_attention_forward on tpu: only the packed (cum_seq) form without "
                                  "dropout, alibi, paged keys or debug mask")
    out, lse = _varlen(query, key, value, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left,
                       window_size_right)
    return (out, lse, jnp.zeros((2,), jnp.uint64), jnp.zeros((), jnp.uint64),
            jnp.zeros((0,), query.dtype))


@lower(aten._flash_attention_backward.default, static_floats=True)
def flash_attention_varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                    dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                                    window_size_right=None):
    def forward(q, k, v):
        return _varlen(q, k, v, cum_seq_q, cum_seq_k, is_causal, scale, window_size_left, window_size_right)[0]

    _, pullback = jax.vjp(forward, query, key, value)
    return pullback(grad_out)
