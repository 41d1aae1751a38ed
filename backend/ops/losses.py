"""Losses: NLL, MSE, binary cross-entropy, Huber, smooth L1, CTC, margin losses, linear + cross-entropy.

Backward ops whose formula is just the VJP of the forward are lowered as
`jax.vjp` of the forward lowering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.modules.linear_cross_entropy  # noqa: F401  (registers the torch_nn ops lowered below)
from jax import lax

from ..core.registry import lower

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


def _ctc_labels(log_probs, targets, target_lengths, blank):
    """The extended label sequence blank, l1, blank, l2, ..., blank per batch entry (N, L),
    which of its positions exist, which may be reached by skipping a blank from two back,
    and log_probs gathered along it (T, N, L). The widest label sequence sets L."""
    t_max, n, _ = log_probs.shape
    s_max = max(target_lengths, default=0)
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
    lp = jnp.take_along_axis(log_probs, jnp.broadcast_to(ext[None], (t_max, n, length)), axis=2)
    return ext, valid, skip, lp


def _ctc(log_probs, targets, input_lengths, target_lengths, blank):
    """CTC negative log likelihood by the forward (alpha) recursion in log space, over the
    extended label sequence. Returns (nll, log_alpha)."""
    if log_probs.ndim == 2:  # unbatched (T, C)
        nll, alpha = _ctc(log_probs[:, None], targets.reshape(1, -1), list(input_lengths),
                          list(target_lengths), blank)
        return nll[0], alpha[0]
    t_max, n, _ = log_probs.shape
    ext, valid, skip, lp = _ctc_labels(log_probs, targets, target_lengths, blank)
    length = ext.shape[1]
    s = jnp.arange(length)
    input_lengths = jnp.asarray(input_lengths, jnp.int64).reshape(n)
    target_lengths = jnp.asarray(target_lengths, jnp.int64).reshape(n)
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
    return nll, jnp.transpose(log_alpha, (1, 0, 2))


@lower(aten._ctc_loss.default)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # As PyTorch's kernel, an impossible alignment's loss stays inf here: ctc_loss (the
    # composite above it) applies zero_infinity; the backward zeroes its gradient.
    return _ctc(log_probs, targets, list(input_lengths), list(target_lengths), blank)


@lower(aten._ctc_loss.Tensor, jit=False)
def ctc_loss_tensor(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    # As PyTorch does, read the lengths to the host: log_alpha's size depends on them.
    return _ctc(log_probs, targets, [int(v) for v in np.asarray(input_lengths).reshape(-1)],
                [int(v) for v in np.asarray(target_lengths).reshape(-1)], blank)


def _ctc_backward(grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity):
    """PyTorch's gradient for log_probs, from the beta (backward) recursion:
    (exp(lp) - exp(log(sum alpha beta over the positions labelled c) + nll - lp)) * grad below
    each input length, 0 after. (The exp(lp) term is one log_softmax's backward cancels.)"""
    if log_probs.ndim == 2:  # unbatched (T, C)
        return _ctc_backward(grad.reshape(1), log_probs[:, None], targets.reshape(1, -1), input_lengths,
                             target_lengths, nll.reshape(1), log_alpha[None], blank, zero_infinity)[:, 0]
    t_max, n, c = log_probs.shape
    ext, valid, skip, lp = _ctc_labels(log_probs, targets, target_lengths, blank)
    length = ext.shape[1]
    s = jnp.arange(length)
    input_lengths = jnp.asarray(input_lengths, jnp.int64).reshape(n)
    target_lengths = jnp.asarray(target_lengths, jnp.int64).reshape(n)
    neg = jnp.asarray(-jnp.inf, log_probs.dtype)
    ends = valid & ((s[None, :] == 2 * target_lengths[:, None]) | (s[None, :] == 2 * target_lengths[:, None] - 1))
    # From s, the next step reaches s, s + 1, and s + 2 where s + 2 may skip back to s.
    skip_next = jnp.concatenate([skip[:, 2:], jnp.zeros((n, min(2, length)), bool)], axis=1)

    def step(beta, inputs):
        t, lp_t = inputs
        b1 = jnp.concatenate([beta[:, 1:], jnp.full((n, 1), neg)], axis=1)
        b2 = jnp.concatenate([beta[:, 2:], jnp.full((n, 2), neg)], axis=1)[:, :length]
        new = jnp.where(valid, jnp.logaddexp(jnp.logaddexp(beta, b1), jnp.where(skip_next, b2, neg)) + lp_t, neg)
        last = (t == input_lengths - 1)[:, None]
        cur = jnp.where(last, jnp.where(ends, lp_t, neg), jnp.where((t < input_lengths - 1)[:, None], new, neg))
        return cur, cur

    _, log_beta = lax.scan(step, jnp.full((n, length), neg), (jnp.arange(t_max), lp), reverse=True)
    ab = jnp.transpose(log_alpha, (1, 0, 2))[:, :, :length] + log_beta  # (T, N, L)
    # log-sum-exp of ab over the positions of each label, per (t, n): a max, then a sum.
    tt = jnp.broadcast_to(jnp.arange(t_max)[:, None, None], ab.shape)
    nn = jnp.broadcast_to(jnp.arange(n)[None, :, None], ab.shape)
    cc = jnp.broadcast_to(ext[None], ab.shape)
    top = jnp.full((t_max, n, c), neg).at[tt, nn, cc].max(ab)
    top_at = top[tt, nn, cc]
    total = jnp.zeros((t_max, n, c), ab.dtype).at[tt, nn, cc].add(
        jnp.where(jnp.isinf(top_at), 0, jnp.exp(ab - jnp.where(jnp.isinf(top_at), 0, top_at))))
    lcab = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1)), neg)
    out = (jnp.exp(log_probs) - jnp.exp(lcab + nll[None, :, None] - log_probs)) * grad[None, :, None]
    out = jnp.where((jnp.arange(t_max)[:, None] < input_lengths[None, :])[..., None], out, 0)
    return jnp.where(jnp.isinf(nll)[None, :, None], 0, out) if zero_infinity else out


@lower(aten._ctc_loss_backward.default)
def ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                      blank, zero_infinity=False):
    return _ctc_backward(grad, log_probs, targets, list(input_lengths), list(target_lengths), neg_log_likelihood,
                         log_alpha, blank, zero_infinity)


@lower(aten._ctc_loss_backward.Tensor, jit=False)
def ctc_loss_backward_tensor(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood,
                             log_alpha, blank, zero_infinity=False):
    return _ctc_backward(grad, log_probs, targets, [int(v) for v in np.asarray(input_lengths).reshape(-1)],
                         [int(v) for v in np.asarray(target_lengths).reshape(-1)], neg_log_likelihood, log_alpha,
                         blank, zero_infinity)


# --- margin losses: PyTorch decomposes the forwards; the backwards are VJPs of the same math ---


def _reduce(per_sample, reduction):
    return per_sample if reduction == 0 else (jnp.mean(per_sample) if reduction == 1 else jnp.sum(per_sample))


def _multi_margin(self, target, p, margin, weight, reduction):
    x = jnp.atleast_2d(self)
    t = jnp.atleast_1d(target)[:, None]
    z = margin - jnp.take_along_axis(x, t, axis=1) + x
    z = jnp.where(z > 0, z, 0)  # a hinge with PyTorch's strict inequality, so at 0 no gradient
    z = z if p == 1 else z * z
    if weight is not None:
        z = z * weight[t]
    z = jnp.where(jnp.arange(x.shape[1]) != t, z, 0)
    if reduction == 0:
        out = jnp.mean(z, axis=1)
        return out.reshape(self.shape[:-1]) if self.ndim else out.reshape(())
    return jnp.mean(z) if reduction == 1 else jnp.sum(z) / z.shape[1]


@lower(aten.multi_margin_loss_backward.default, static_floats=True)
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), self)
    return vjp(grad_output)[0]


def _multilabel_margin(self, target, reduction):
    """Per sample: the hinge 1 - (x[y_j] - x[i]) summed over its labels y_j (those before the
    first -1) and the classes i that are not labels, over the number of classes."""
    x, t = jnp.atleast_2d(self), jnp.atleast_2d(target)
    dim = x.shape[1]
    idx = jnp.arange(dim)
    labelled = idx < jnp.min(jnp.where(t == -1, idx, dim), axis=-1, keepdims=True)  # (N, j)
    u = jnp.take_along_axis(x, jnp.where(labelled, t, 0), axis=1)
    is_target = jnp.any(idx[None, None, :] == jnp.where(labelled, t, -1)[:, :, None], axis=1)  # (N, i)
    z = 1 - u[:, :, None] + x[:, None, :]
    z = jnp.where((z > 0) & labelled[:, :, None] & ~is_target[:, None, :], z, 0) / dim
    per_sample = jnp.sum(z, axis=(1, 2))
    if reduction == 0:
        return per_sample.reshape(self.shape[:-1])
    return _reduce(per_sample, reduction)


@lower(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    _, vjp = jax.vjp(lambda x: _multilabel_margin(x, target, reduction), self)
    return vjp(grad_output)[0]


# --- linear + cross-entropy (F.linear_cross_entropy's chunked custom ops) ----------------------
# PyTorch computes these chunk by chunk to bound memory; here XLA sees the whole computation
# (logits, loss and, for the reduced op, its gradients, which the op returns precomputed).

_torch_nn = torch.ops.torch_nn


def _linear_ce(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing):
    """F.cross_entropy(input @ linear_weight.T + linear_bias, target, weight, ...) for class index targets, with
    PyTorch's label smoothing (its weighted mean normalisation too), or for class-probability targets (PyTorch
    2.14's chunked op takes those)."""
    x = input.astype(jnp.float32) if input.dtype in (jnp.float16, jnp.bfloat16) else input
    logits = jnp.matmul(x, linear_weight.T.astype(x.dtype))
    if linear_bias is not None:
        logits = logits + linear_bias.astype(x.dtype)
    logp = jax.nn.log_softmax(logits, axis=-1)
    classes = logp.shape[-1]
    if jnp.issubdtype(target.dtype, jnp.floating):
        return _probability_ce(logp, target, weight, reduction, label_smoothing)
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0)
    w = weight.astype(x.dtype) if weight is not None else jnp.ones((classes,), x.dtype)
    w_t = jnp.where(keep, w[safe], 0)
    nll = -jnp.take_along_axis(logp, safe[:, None], axis=-1)[:, 0] * w_t
    smooth = jnp.where(keep, -jnp.sum(logp * w, axis=-1), 0)
    if reduction == "none":
        nll_r, smooth_r = nll, smooth
    elif reduction == "sum":
        nll_r, smooth_r = jnp.sum(nll), jnp.sum(smooth)
    else:
        total = jnp.sum(w_t)
        nll_r, smooth_r = jnp.sum(nll) / total, jnp.sum(smooth) / total
    if not label_smoothing:
        return nll_r
    return (1 - label_smoothing) * nll_r + smooth_r * (label_smoothing / classes)


def _probability_ce(logp, target, weight, reduction, label_smoothing):
    """Class-probability targets (one row of probabilities per input row), as F.cross_entropy: smoothing mixes
    the target with the uniform distribution, a class weight scales each class's term, and the mean divides by
    the number of rows, not by the weights."""
    classes = logp.shape[-1]
    t = target.astype(logp.dtype)
    if label_smoothing:
        t = t * (1 - label_smoothing) + label_smoothing / classes
    if weight is not None:
        t = t * weight.astype(logp.dtype)
    per_row = -jnp.sum(logp * t, axis=-1)
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return jnp.sum(per_row)
    if not per_row.size:
        return jnp.array(jnp.nan, logp.dtype)
    return jnp.sum(per_row) / per_row.size


@lower(_torch_nn._linear_cross_entropy_batch_chunked.default, static_floats=True)
def linear_cross_entropy_batch_chunked(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                       label_smoothing, batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
                                       compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
    """The loss and its gradients for input, linear_weight and linear_bias (each an empty
    (0, ...) array when not asked for), in input's dtype, as PyTorch's op."""
    def loss(x, lw, lb):
        return _linear_ce(x, lw, target, lb, weight, reduction, ignore_index, label_smoothing)

    value, (gi, gw, gb) = jax.value_and_grad(loss, argnums=(0, 1, 2))(input, linear_weight, linear_bias)
    dtype = input.dtype
    gi = gi.astype(dtype) if compute_input_grad else jnp.zeros((0, 0), dtype)
    gw = gw.astype(dtype) if compute_linear_weight_grad else jnp.zeros((0, 0), dtype)
    gb = gb.astype(dtype) if compute_linear_bias_grad and gb is not None else jnp.zeros((0,), dtype)
    return value.astype(dtype), gi, gw, gb


@lower(_torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default)
def linear_cross_entropy_batch_chunked_no_reduction(input, linear_weight, target, linear_bias, weight, ignore_index,
                                                    batch_chunk_size, acc_policy, acc_dtype):
    return _linear_ce(input, linear_weight, target, linear_bias, weight, "none", ignore_index, 0.0).astype(input.dtype)
