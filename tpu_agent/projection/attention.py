"""Attention as one op while recording, lowered as a memory-efficient (query-chunked) JAX attention.

On `meta`, `scaled_dot_product_attention` would decompose into PyTorch's math path, whose saved
softmax is (batch, heads, seq, seq) per layer: a TPU runs a flash/splash kernel that saves only the output
and a log-sum-exp. The recorder therefore sees `tpu_project::attention` and its backward (custom ops with
meta kernels), and the lowering computes them in query chunks, recomputing the scores in backward.
"""

from __future__ import annotations

import contextlib
import math

import torch

CHUNK = 2048  # query rows per chunk in the lowering
# Causal attention: query rows per block, each block computed against the keys up to its last row only, as a
# flash/splash kernel skips the key blocks wholly above the diagonal (MaxText's splash default block: 512,
# base.yml sa_block_q/sa_block_kv). The dots then hold (n + 1) / 2n of the full scores for n blocks (0.53 at
# 8192/512), where MFU's convention counts them all.
CAUSAL_BLOCK = 512
SCOPE = "tpu_project_attention"  # the name scope of the lowering's ops in the HLO (partition.py reads it)


@torch.library.custom_op("tpu_project::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("tpu_project::attention runs on meta only")


@attention.register_fake
def _(q, k, v, mask, causal, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("tpu_project::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("tpu_project::attention_backward runs on meta only")


@attention_backward.register_fake
def _(grad, q, k, v, mask, out, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, mask, causal, scale = inputs
    ctx.save_for_backward(q, k, v, mask, *output) if mask is not None else ctx.save_for_backward(q, k, v, *output)
    ctx.has_mask, ctx.causal, ctx.scale = mask is not None, causal, scale


def _backward(ctx, grad_out, _grad_lse):
    saved = ctx.saved_tensors
    if ctx.has_mask:
        q, k, v, mask, out, lse = saved
    else:
        (q, k, v, out, lse), mask = saved, None
    dq, dk, dv = attention_backward(grad_out.contiguous(), q, k, v, mask, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention.register_autograd(_backward, setup_context=_setup)


_ORIGINAL = torch.nn.functional.scaled_dot_product_attention


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
    if query.device.type == "meta" and not dropout_p and not kw:
        scale = scale or 1.0 / math.sqrt(query.shape[-1])
        return attention(query, key, value, attn_mask, bool(is_causal), float(scale))[0]
    return _ORIGINAL(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa, **kw)


@contextlib.contextmanager
def intercept():
    """`F.scaled_dot_product_attention` on meta tensors runs as one op while the script runs (patched on the
    module, not through a mode: activation checkpointing recomputes inside autograd, where modes do not reach)."""
    functional = torch.nn.functional
    functional.scaled_dot_product_attention = _sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = _ORIGINAL


def flops(q_shape, k_shape, v_shape, backward: bool) -> float:
    """Matmul FLOPs of the attention (scores and weighted sum), as counted for MFU: 2 matmuls forward,
    4 backward (plus the recomputed scores, not model FLOPs)."""
    *batch, sq, d = q_shape
    sk, dv = k_shape[-2], v_shape[-1]
    n = math.prod(batch)
    forward = 2.0 * n * sq * sk * (d + dv)
    return 2 * forward if backward else forward


# ---------------------------------------------------------------- the JAX lowering


def _blocks(sq: int, sk: int, causal: bool) -> list[tuple[int, int]]:
    """(first query row, keys it needs) per query block: all keys, or for causal attention (queries aligned to
    the last keys) only those up to the block's last row."""
    size = CAUSAL_BLOCK if causal else CHUNK
    offset = sk - sq
    return [(start, min(sk, offset + start + size) if causal else sk) for start in range(0, sq, size)]


def _scores(q, k, mask, causal, scale, start, offset=0):
    import jax.numpy as jnp

    s = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        m = mask[..., start:start + q.shape[-2], :] if mask.shape[-2] > 1 else mask
        m = m[..., :k.shape[-2]] if m.shape[-1] > 1 else m
        s = jnp.where(m, s, -jnp.inf) if m.dtype == jnp.bool_ else s + m.astype(s.dtype)
    if causal:
        rows = jnp.arange(q.shape[-2])[:, None] + start + offset
        s = jnp.where(rows >= jnp.arange(k.shape[-2])[None, :], s, -jnp.inf)
    return s


def _expand(k, heads):
    import jax.numpy as jnp

    return k if k.shape[-3] == heads else jnp.repeat(k, heads // k.shape[-3], axis=-3)


def lower_forward(q, k, v, mask, causal, scale):
    import jax
    import jax.numpy as jnp

    k, v = _expand(k, q.shape[-3]), _expand(v, q.shape[-3])
    outs, lses = [], []
    sq, sk = q.shape[-2], k.shape[-2]
    for start, keys in _blocks(sq, sk, causal):
        end = min(sq, start + (CAUSAL_BLOCK if causal else CHUNK))
        s = _scores(q[..., start:end, :], k[..., :keys, :], mask, causal, scale, start, sk - sq)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None]).astype(v.dtype)
        outs.append(jnp.einsum("...qk,...kd->...qd", p, v[..., :keys, :]))
        lses.append(lse)
    return jnp.concatenate(outs, axis=-2), jnp.concatenate(lses, axis=-1)


def lower_backward(grad, q, k, v, mask, out, lse, causal, scale):
    import jax.numpy as jnp

    kv_heads = k.shape[-3]
    ke, ve = _expand(k, q.shape[-3]), _expand(v, q.shape[-3])
    dqs = []
    sq, sk = q.shape[-2], k.shape[-2]
    dk = jnp.zeros(ke.shape, jnp.float32)
    dv = jnp.zeros(ve.shape, jnp.float32)
    for start, keys in _blocks(sq, sk, causal):
        sl = slice(start, min(sq, start + (CAUSAL_BLOCK if causal else CHUNK)))
        qc, gc, oc = q[..., sl, :], grad[..., sl, :], out[..., sl, :]
        kc, vc = ke[..., :keys, :], ve[..., :keys, :]
        s = _scores(qc, kc, mask, causal, scale, start, sk - sq)
        p = jnp.exp(s - lse[..., sl, None])
        dv = dv.at[..., :keys, :].add(
            jnp.einsum("...qk,...qd->...kd", p.astype(gc.dtype), gc, preferred_element_type=jnp.float32))
        dp = jnp.einsum("...qd,...kd->...qk", gc, vc, preferred_element_type=jnp.float32)
        delta = jnp.sum(gc.astype(jnp.float32) * oc.astype(jnp.float32), axis=-1, keepdims=True)
        ds = (p * (dp - delta) * scale).astype(q.dtype)
        dqs.append(jnp.einsum("...qk,...kd->...qd", ds, kc))
        dk = dk.at[..., :keys, :].add(
            jnp.einsum("...qk,...qd->...kd", ds, qc, preferred_element_type=jnp.float32))
    groups = q.shape[-3] // kv_heads

    def fold(x):
        if groups == 1:
            return x
        return x.reshape(*x.shape[:-3], kv_heads, groups, *x.shape[-2:]).sum(axis=-3)

    return jnp.concatenate(dqs, axis=-2), fold(dk).astype(k.dtype), fold(dv).astype(v.dtype)

