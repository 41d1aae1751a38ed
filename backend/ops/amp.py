"""Gradient scaling ops `torch.amp.GradScaler` calls on the device (CUDA's kernels' semantics)."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from ..core.registry import lower

aten = torch.ops.aten


@lower(aten._amp_foreach_non_finite_check_and_unscale)
def _amp_foreach_non_finite_check_and_unscale(grads, found_inf, inv_scale):
    """Every gradient times `inv_scale`; `found_inf` becomes 1 if any value is inf or nan."""
    bad = [jnp.any(~jnp.isfinite(g)) for g in grads]
    found = jnp.maximum(found_inf, jnp.any(jnp.stack(bad)).astype(found_inf.dtype)) if bad else found_inf
    return [(g * inv_scale).astype(g.dtype) for g in grads], found


@lower(aten._amp_update_scale)
def _amp_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Back off on an overflow; grow after `growth_interval` clean steps (if the result is finite)."""
    overflow = found_inf > 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = (scale * growth_factor).astype(scale.dtype)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    new_scale = jnp.where(overflow, (scale * backoff_factor).astype(scale.dtype), jnp.where(grow, grown, scale))
    new_tracker = jnp.where(overflow | grow, jnp.zeros_like(growth_tracker), successful.astype(growth_tracker.dtype))
    return new_scale, new_tracker
