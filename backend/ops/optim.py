"""Fused Adam / AdamW (`torch.optim.Adam(fused=True)`, transformers' default `adamw_torch_fused`):
one program per step over every parameter, with the CPU fused kernel's semantics
(`grad_scale` unscales the gradients in place, `found_inf` skips the step).

The CPU kernel computes its bias corrections `1 - beta ** step` in double. In float32, with `beta2`
itself rounded (float32(0.999) is 1.3e-8 off), `1 - beta2 ** 1` comes out 1.3e-5 off, so every
update was about 6e-6 too large or small and training drifted from the CPU (issue #28). The betas
are therefore program constants, and the corrections `-expm1(step * log(beta))` use `log(beta)` and
`1 - beta` taken in double on the host: accurate to a few float32 ulps. Only the `tensor_lr` overloads are lowered: handlers.py runs a float
learning rate as a 0-d tensor, so a scheduler's new value every step reuses the program.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import torch

from ..core.registry import lower

aten = torch.ops.aten


def _fused_adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                       weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None, decoupled):
    f32 = jnp.float32
    lr = jnp.asarray(lr).reshape(()).astype(f32)
    # Host doubles, as the CPU kernel's: the coefficients of the moments and the logs of the corrections.
    one_minus_beta1, one_minus_beta2 = 1.0 - beta1, 1.0 - beta2
    log_beta1 = math.log(beta1) if beta1 > 0 else -math.inf
    log_beta2 = math.log(beta2) if beta2 > 0 else -math.inf
    outs = ([], [], [], [], [])
    skip = None if found_inf is None else found_inf.reshape(()) > 0
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        param, grad = p.astype(f32), g.astype(f32)
        if grad_scale is not None:
            grad = grad / grad_scale.reshape(()).astype(f32)
        stored_grad = grad
        if maximize:
            grad = -grad
        if decoupled:
            param = param * (1 - lr * weight_decay)
        elif weight_decay:
            grad = grad + weight_decay * param
        exp_avg = m.astype(f32) * beta1 + grad * one_minus_beta1
        exp_avg_sq = v.astype(f32) * beta2 + grad * grad * one_minus_beta2
        t = step.reshape(()).astype(f32)
        bias_correction1 = -jnp.expm1(t * log_beta1)
        bias_correction2_sqrt = jnp.sqrt(-jnp.expm1(t * log_beta2))
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


# Adam adds weight decay to the gradient; AdamW decays the parameter (decoupled). Floats are constants
# (betas, eps and weight decay stay fixed while training); the learning rate is a tensor.
for _packet, _decoupled in ((aten._fused_adam, False), (aten._fused_adamw, True)):
    lower(_packet.tensor_lr, static_floats=True)(functools.partial(_fused_adam_update, decoupled=_decoupled))
