"""Losses: NLL, MSE, binary cross-entropy, Huber, smooth L1, CTC.

Backward ops whose formula is just the VJP of the forward are lowered as
`jax.vjp` of the forward lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..registry import lower

aten = torch.ops.aten


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _nll(self, target, weight, reduction, ignore_index):
    batched = self.ndim >= 2
    logp = self if batched else self[None]
    tgt = target if batched else target[None]
    logp = jnp.moveaxis(logp, 1, -1)  # (N, ..., C)
    valid = tgt != ignore_index
    safe = jnp.where(valid, tgt, 0)
    picked = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    w = weight[safe] if weight is not None else jnp.ones_like(picked)
    w = jnp.where(valid, w, 0)
    losses = picked * w
    if reduction == 0:
        return losses if batched else losses[0], jnp.zeros((), self.dtype)
    total_weight = jnp.sum(w)
    total = jnp.sum(losses)
    return (total / total_weight if reduction == 1 else total), total_weight


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(self, target, weight, reduction, ignore_index):
    return _nll(self, target, weight, reduction, ignore_index)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    _, vjp = jax.vjp(lambda x: _nll(x, target, weight, reduction, ignore_index)[0], self)
    return vjp(grad_output)[0]


@lower(aten.mse_loss.default)
def mse_loss(self, target, reduction=1):
    out = jnp.square(self - target)
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


@lower(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    scale = 2.0 / self.size if reduction == 1 else 2.0
    return grad_output * scale * (self - target)


@lower(aten.binary_cross_entropy.default)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    log_p = jnp.maximum(jnp.log(self), -100)
    log_1p = jnp.maximum(jnp.log1p(-self), -100)
    out = -(target * log_p + (1 - target) * log_1p)
    if weight is not None:
        out = out * weight
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


@lower(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x: binary_cross_entropy(x, target, weight, reduction), self)
    return vjp(grad_output)[0]


@lower(aten.huber_loss.default)
def huber_loss(self, target, reduction=1, delta=1.0):
    d = jnp.abs(self - target)
    out = jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


@lower(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    d = jnp.abs(self - target)
    out = jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta) if not (not isinstance(beta, jax.Array) and beta == 0) else d
    return out if reduction == 0 else (jnp.mean(out) if reduction == 1 else jnp.sum(out))


# --- CTC loss --------------------------------------------------------------------------------


def _ctc(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
    """CTC negative log likelihood by the forward (alpha) recursion in log space, over the
    extended label sequence blank, l1, blank, l2, ..., blank. Returns (nll, log_alpha)."""
    if log_probs.ndim == 2:  # unbatched (T, C)
        nll, alpha = _ctc(log_probs[:, None], targets.reshape(1, -1), list(input_lengths),
                          list(target_lengths), blank, zero_infinity)
        return nll[0], alpha[0]
    t_max, n, _ = log_probs.shape
    # The lengths are Python lists here: the widest label sequence sets log_alpha's size.
    s_max = max(target_lengths, default=0)
    input_lengths = jnp.asarray(input_lengths, jnp.int64).reshape(n)
    target_lengths = jnp.asarray(target_lengths, jnp.int64).reshape(n)
    if targets.ndim == 1:  # concatenated targets: gather each sequence from its offset
        offsets = jnp.cumsum(target_lengths) - target_lengths
        idx = jnp.clip(offsets[:, None] + jnp.arange(s_max), 0, max(targets.shape[0] - 1, 0))
        labels = targets[idx] if targets.shape[0] else jnp.zeros((n, 0), jnp.int64)
    else:
        labels = targets[:, :s_max]
    length = 2 * s_max + 1
    s = jnp.arange(length)
    ext = jnp.where(s % 2 == 0, blank, labels[:, jnp.clip((s - 1) // 2, 0, max(s_max - 1, 0))] if s_max else blank)
    ext = ext.astype(jnp.int64)
    valid = s[None, :] < 2 * target_lengths[:, None] + 1
    prev2 = jnp.concatenate([ext[:, :2], ext[:, :-2]], axis=1) if length > 2 else ext
    skip = (s % 2 == 1)[None, :] & (s >= 2)[None, :] & (ext != prev2)
    lp = jnp.take_along_axis(log_probs, jnp.broadcast_to(ext[None], (t_max, n, length)), axis=2)  # (T, N, L)
    neg = jnp.asarray(-jnp.inf, log_probs.dtype)
    init = jnp.where((s == 0)[None, :] | ((s == 1)[None, :] & (target_lengths[:, None] > 0)), lp[0], neg)
    init = jnp.where(valid, init, neg)

    def step(alpha, inputs):
        t, lp_t = inputs
        a1 = jnp.concatenate([jnp.full((n, 1), neg), alpha[:, :-1]], axis=1)
        a2 = jnp.concatenate([jnp.full((n, 2), neg), alpha[:, :-2]], axis=1)[:, :length]
        new = jnp.logaddexp(jnp.logaddexp(alpha, a1), jnp.where(skip, a2, neg)) + lp_t
        new = jnp.where(valid, new, neg)
        live = (t < input_lengths)[:, None]
        return jnp.where(live, new, alpha), jnp.where(live, new, neg)

    final, rest = lax.scan(step, init, (jnp.arange(1, t_max), lp[1:]))
    log_alpha = jnp.concatenate([jnp.where((input_lengths > 0)[:, None], init, neg)[None], rest], axis=0)
    last = jnp.take_along_axis(final, (2 * target_lengths)[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(final, jnp.maximum(2 * target_lengths - 1, 0)[:, None], axis=1)[:, 0]
    nll = -jnp.logaddexp(last, jnp.where(target_lengths > 0, before, neg))
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), 0, nll)
    return nll, jnp.transpose(log_alpha, (1, 0, 2))


@lower(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    return _ctc(log_probs, targets, list(input_lengths), list(target_lengths), blank, zero_infinity)


@lower(aten._ctc_loss.Tensor, jit=False)
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # As PyTorch does, read the lengths to the host: log_alpha's size depends on them.
    return _ctc(log_probs, targets, [int(v) for v in np.asarray(input_lengths).reshape(-1)],
                [int(v) for v in np.asarray(target_lengths).reshape(-1)], blank, zero_infinity)
