"""Random ops on the device: JAX's counter-based PRNG, seeded by `torch.manual_seed`.

Streams are reproducible for a seed but differ from the CPU's, as CUDA's do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from ..core.registry import lower
from ._util import default_float, jdtype

aten = torch.ops.aten


def _float(dtype):
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32


@lower(aten.rand.default, random=True)
def rand(size, *, dtype=None, layout=None, device=None, pin_memory=None, generator=None, key):
    return jax.random.uniform(key, tuple(size), jdtype(dtype, default_float()))


@lower(aten.randn.default, random=True)
def randn(size, *, dtype=None, layout=None, device=None, pin_memory=None, generator=None, key):
    return jax.random.normal(key, tuple(size), jdtype(dtype, default_float()))


def _randint(key, size, low, high, dtype):
    # PyTorch also draws integers into float dtypes (randint(..., dtype=torch.float32)).
    want = jdtype(dtype, jnp.int64)
    draw = want if jnp.issubdtype(want, jnp.integer) else jnp.int64
    return jax.random.randint(key, tuple(size), low, high, draw).astype(want)


@lower(aten.randint.default, random=True)
def randint(high, size, *, dtype=None, layout=None, device=None, pin_memory=None, generator=None, key):
    return _randint(key, size, 0, high, dtype)


@lower(aten.randint.low, random=True)
def randint_low(low, high, size, *, dtype=None, layout=None, device=None, pin_memory=None, generator=None, key):
    return _randint(key, size, low, high, dtype)


@lower(aten.randperm.default, random=True)
def randperm(n, *, dtype=None, layout=None, device=None, pin_memory=None, generator=None, key):
    return jax.random.permutation(key, n).astype(jdtype(dtype, jnp.int64))


@lower(aten.uniform_.default, random=True)
def uniform_(self, from_=0.0, to=1.0, *, generator=None, key):
    return jax.random.uniform(key, self.shape, _float(self.dtype), from_, to).astype(self.dtype)


@lower(aten.normal_.default, random=True)
def normal_(self, mean=0.0, std=1.0, *, generator=None, key):
    return (mean + std * jax.random.normal(key, self.shape, _float(self.dtype))).astype(self.dtype)


@lower(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True)
def normal(mean, std=1.0, *, generator=None, key):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dtype = jnp.result_type(mean, std)
    return mean + std * jax.random.normal(key, shape, _float(dtype))


@lower(aten.normal.float_float, random=True)
def normal_float_float(mean, std, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    return mean + std * jax.random.normal(key, tuple(size), jdtype(dtype, default_float()))


@lower(aten.bernoulli_.float, random=True)
def bernoulli_float_(self, p=0.5, *, generator=None, key):
    return jax.random.bernoulli(key, p, self.shape).astype(self.dtype)


@lower(aten.bernoulli_.Tensor, random=True)
def bernoulli_tensor_(self, p, *, generator=None, key):
    return jax.random.bernoulli(key, jnp.broadcast_to(p, self.shape)).astype(self.dtype)


@lower(aten.bernoulli.default, random=True)
def bernoulli(self, *, generator=None, key):
    return jax.random.bernoulli(key, self).astype(self.dtype)


@lower(aten.bernoulli.p, random=True)
def bernoulli_p(self, p, *, generator=None, key):
    return jax.random.bernoulli(key, p, self.shape).astype(self.dtype)


@lower(getattr(aten.random_, "from"), random=True)
def random_from(self, from_, to=None, *, generator=None, key):
    high = to if to is not None else (2**53 if jnp.issubdtype(self.dtype, jnp.floating) else jnp.iinfo(self.dtype).max)
    return jax.random.randint(key, self.shape, from_, high, jnp.int64).astype(self.dtype)


@lower(aten.random_.to, random=True)
def random_to(self, to, *, generator=None, key):
    return jax.random.randint(key, self.shape, 0, to, jnp.int64).astype(self.dtype)


@lower(aten.exponential_.default, random=True)
def exponential_(self, lambd=1.0, *, generator=None, key):
    return (jax.random.exponential(key, self.shape, _float(self.dtype)) / lambd).astype(self.dtype)


@lower(aten.native_dropout.default, random=True)
def native_dropout(input, p, train, *, key):
    if train is False or (not isinstance(p, jax.Array) and p == 0):
        return input, jnp.ones(input.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, input.shape)
    scale = jnp.where(p < 1, 1.0 / (1.0 - p), 0.0).astype(input.dtype)
    return jnp.where(keep, input * scale, jnp.zeros((), input.dtype)), keep


@lower(aten.native_dropout_backward.default)
def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask.astype(grad_output.dtype) * scale


@lower(aten.rand_like.default, random=True)
def rand_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    return jax.random.uniform(key, self.shape, jdtype(dtype, _float(self.dtype)))


@lower(aten.randn_like.default, random=True)
def randn_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    return jax.random.normal(key, self.shape, jdtype(dtype, _float(self.dtype)))


@lower(aten.randint_like.default, aten.randint_like.Tensor, random=True)
def randint_like(self, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    out = jdtype(dtype, self.dtype)
    return jax.random.randint(key, self.shape, 0, high, jnp.int64).astype(out)


@lower(aten.randint_like.low_dtype, random=True)
def randint_like_low(self, low, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    out = jdtype(dtype, self.dtype)
    return jax.random.randint(key, self.shape, low, high, jnp.int64).astype(out)


@lower(aten.multinomial.default, random=True)
def multinomial(self, num_samples, replacement=False, *, generator=None, key):
    """Draws category indices with probabilities proportional to the rows of `self`;
    without replacement by the Gumbel top-k trick."""
    logits = jnp.log(self.astype(_float(self.dtype)))
    if replacement:
        shape = (num_samples,) + self.shape[:-1]
        draws = jax.random.categorical(key, logits, axis=-1, shape=shape)
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    gumbel = jax.random.gumbel(key, self.shape, logits.dtype)
    return jax.lax.top_k(logits + gumbel, num_samples)[1].astype(jnp.int64)


@lower(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(self, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None, *, key):
    """Randomized leaky ReLU: in training each negative input gets a slope drawn from
    U(lower, upper), recorded in `noise` (1 for non-negative inputs); else the mean slope."""
    if not training:
        return jnp.where(self >= 0, self, self * ((lower + upper) / 2)).astype(self.dtype), noise
    slope = jax.random.uniform(key, self.shape, _float(self.dtype), lower, upper)
    neg = self < 0
    return jnp.where(neg, self * slope, self).astype(self.dtype), jnp.where(neg, slope, 1).astype(noise.dtype)
