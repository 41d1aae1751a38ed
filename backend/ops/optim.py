"""Fused Adam / AdamW (`torch.optim.Adam(fused=True)`, transformers' default `adamw_torch_fused`):
one program per step over every parameter, with the CUDA/CPU fused kernels' semantics
(float32 math, `grad_scale` unscales the gradients in place, `found_inf` skips the step)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import torch

from ..registry import lower

aten = torch.ops.aten


def _fused_adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                       weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None, decoupled):
    f32 = jnp.float32
    outs = ([], [], [], [], [])
    skip = None if found_inf is None else found_inf.reshape(()) > 0
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        param, grad = p.astype(f32), g.astype(f32)
        if grad_scale is not None:
            grad = grad / grad_scale.reshape(()).astype(f32)
        stored_grad = grad
        if maximize:
            grad = -grad
        # weight_decay arrives traced: with 0 both forms leave the values unchanged.
        if decoupled:
            param = param * (1 - lr * weight_decay)
        else:
            grad = grad + weight_decay * param
        exp_avg = m.astype(f32) + (grad - m.astype(f32)) * (1 - beta1)
        exp_avg_sq = v.astype(f32) * beta2 + (1 - beta2) * grad * grad
        t = step.reshape(()).astype(f32)
        bias_correction1 = 1 - beta1 ** t
        bias_correction2_sqrt = jnp.sqrt(1 - beta2 ** t)
        new = [param, stored_grad, exp_avg, exp_avg_sq]
        if amsgrad:
            max_sq = jnp.maximum(max_exp_avg_sqs[i].astype(f32), exp_avg_sq)
            denom = jnp.sqrt(max_sq) / bias_correction2_sqrt + eps
            new.append(max_sq)
        else:
            denom = jnp.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        new[0] = param - (lr / bias_correction1) * exp_avg / denom
        old = [p, g, m, v] + ([max_exp_avg_sqs[i]] if amsgrad else [])
        for out, value, before in zip(outs, new, old):
            value = value.astype(before.dtype)
            out.append(value if skip is None else jnp.where(skip, before, value))
    if not amsgrad:
        outs = outs[:4] + (list(max_exp_avg_sqs),)
    return tuple(list(o) for o in outs)


# Adam adds weight decay to the gradient; AdamW decays the parameter (decoupled).
for _packet, _decoupled in ((aten._fused_adam, False), (aten._fused_adamw, True)):
    lower(_packet)(functools.partial(_fused_adam_update, decoupled=_decoupled))
