"""Resampling: grid sampling, antialiased bilinear / bicubic interpolation, the upsample backwards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..core.registry import lower

aten = torch.ops.aten


# --- grid sampling ---------------------------------------------------------------------------


def _grid_source_index(coords, size, padding_mode, align_corners):
    """Grid coordinates in [-1, 1] to input positions, with padding_mode 0 zeros, 1 border, 2 reflection."""
    mul = (size * 0.5 - 0.5) if align_corners else (size * 0.5)
    x = coords * mul + (size * 0.5 - 0.5)
    if padding_mode == 0:
        return x
    if padding_mode == 2:
        low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        span = high - low
        if span <= 0:
            x = jnp.zeros_like(x)
        else:
            d = jnp.abs(x - low)
            extra = jnp.fmod(d, span)
            flips = jnp.floor(d / span).astype(jnp.int64)
            x = jnp.where(flips % 2 == 0, extra + low, span + low - extra)
    return jnp.clip(x, 0, size - 1)


def _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners):
    """Sample input (N, C, *spatial) at grid (N, *out, nd) (last coordinate = first spatial
    dim reversed: x is width). Bilinear / trilinear (mode 0) or nearest (mode 1)."""
    n, c = input.shape[:2]
    spatial = input.shape[2:]
    nd = len(spatial)
    out_shape = grid.shape[1:-1]
    pos = [_grid_source_index(grid[..., nd - 1 - d], spatial[d], padding_mode, align_corners) for d in range(nd)]
    flat_input = input.reshape(n, c, -1)

    def gather(idx):  # idx: per-dim integer positions (N, *out); out of bounds reads as 0
        ok = jnp.ones(idx[0].shape, bool)
        flat = jnp.zeros(idx[0].shape, jnp.int64)
        for d in range(nd):
            ok = ok & (idx[d] >= 0) & (idx[d] < spatial[d])
            flat = flat * spatial[d] + jnp.clip(idx[d], 0, spatial[d] - 1)
        flat = jnp.broadcast_to(flat.reshape(n, 1, -1), (n, c, flat[0].size))
        vals = jnp.take_along_axis(flat_input, flat, axis=-1).reshape((n, c) + out_shape)
        return jnp.where(ok[:, None], vals, 0)

    if interpolation_mode == 1:
        return gather([jnp.round(p).astype(jnp.int64) for p in pos])
    if interpolation_mode != 0:
        raise NotImplementedError(f"grid_sampler with interpolation_mode={interpolation_mode} and {nd} spatial dims")
    lo = [jnp.floor(p) for p in pos]
    out = jnp.zeros((n, c) + out_shape, input.dtype)
    for corner in np.ndindex(*(2,) * nd):
        idx, w = [], jnp.ones(grid.shape[:-1], input.dtype)
        for d, bit in enumerate(corner):
            w = w * ((pos[d] - lo[d]) if bit else (lo[d] + 1 - pos[d]))
            idx.append((lo[d] + bit).astype(jnp.int64))
        out = out + gather(idx) * w[:, None]
    return out


@lower(aten.grid_sampler_3d.default)
def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(input, grid, interpolation_mode, padding_mode, align_corners)


def _grid_sample_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    _, vjp = jax.vjp(lambda x, g: _grid_sample(x, g, interpolation_mode, padding_mode, align_corners), input, grid)
    grad_input, grad_grid = vjp(grad_output)
    return (grad_input if output_mask[0] else None), grad_grid


@lower(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sample_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask)


@lower(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    return _grid_sample_backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask)


# --- antialiased resampling ------------------------------------------------------------------


def _aa_linear(x):
    return np.maximum(0.0, 1.0 - np.abs(x))


def _aa_cubic(x, a=-0.5):
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _aa_weights(in_size, out_size, align_corners, scale, filter_fn, interp_size):
    """PyTorch's antialiasing interpolation weights (UpSampleKernel.cpp), one row per output
    position: a triangle / cubic filter widened by the downscale factor, normalized."""
    f32 = np.float32
    if align_corners:
        s = f32((in_size - 1) / (out_size - 1)) if out_size > 1 else f32(0)
    else:
        s = f32(1.0 / scale) if scale is not None and scale > 0 else f32(in_size / out_size)
    support = f32(interp_size * 0.5) * s if s >= 1 else f32(interp_size * 0.5)
    invscale = f32(1.0) / s if s >= 1 else f32(1.0)
    w = np.zeros((out_size, in_size), np.float32)
    for i in range(out_size):
        center = s * f32(i + 0.5)
        lo = max(int(center - support + f32(0.5)), 0)
        hi = min(int(center + support + f32(0.5)), in_size)
        j = np.arange(lo, hi)
        row = filter_fn((j - center + f32(0.5)).astype(f32) * invscale).astype(f32)
        total = row.sum(dtype=f32)
        w[i, lo:hi] = row / total if total != 0 else row
    return w


def _upsample_aa(self, output_size, align_corners, scales, filter_fn, interp_size):
    h, w = self.shape[-2:]
    oh, ow = output_size
    wh = _aa_weights(h, oh, align_corners, scales[0], filter_fn, interp_size)
    ww = _aa_weights(w, ow, align_corners, scales[1], filter_fn, interp_size)
    x = self.astype(jnp.float32) if self.dtype in (jnp.float16, jnp.bfloat16) else self
    out = jnp.einsum("oh,...hw,pw->...op", jnp.asarray(wh, x.dtype), x, jnp.asarray(ww, x.dtype),
                     precision=lax.Precision.HIGHEST)
    return out.astype(self.dtype)


def _aa_size(input, output_size, scale_factors):
    if output_size is not None:
        return tuple(output_size), (None, None)
    h, w = input.shape[-2:]
    return (int(h * scale_factors[0]), int(w * scale_factors[1])), tuple(scale_factors)


@lower(aten._upsample_bilinear2d_aa.default, static_floats=True)
def upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(self, output_size, align_corners, (scales_h, scales_w), _aa_linear, 2)


@lower(aten._upsample_bilinear2d_aa.vec, static_floats=True)
def upsample_bilinear2d_aa_vec(input, output_size, align_corners, scale_factors):
    size, scales = _aa_size(input, output_size, scale_factors)
    return _upsample_aa(input, size, align_corners, scales, _aa_linear, 2)


@lower(aten._upsample_bicubic2d_aa.default, static_floats=True)
def upsample_bicubic2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(self, output_size, align_corners, (scales_h, scales_w), _aa_cubic, 4)


@lower(aten._upsample_bicubic2d_aa.vec, static_floats=True)
def upsample_bicubic2d_aa_vec(input, output_size, align_corners, scale_factors):
    size, scales = _aa_size(input, output_size, scale_factors)
    return _upsample_aa(input, size, align_corners, scales, _aa_cubic, 4)


# --- interpolation backward: the transposed per-dimension resampling matrices ---------------
# PyTorch decomposes the upsample forwards; their backwards are linear maps of the gradient:
# one (out, in) matrix per spatial dim, built on the host with PyTorch's index arithmetic
# (float32, as its kernels), applied transposed.


def _area_scale(in_size, out_size, align_corners, scale):
    """PyTorch's area_pixel_compute_scale: input pixels per output pixel."""
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else in_size / out_size


def _source_index(in_size, out_size, align_corners, scale):
    s = np.float32(_area_scale(in_size, out_size, align_corners, scale))
    i = np.arange(out_size, dtype=np.float32)
    return s * i if align_corners else s * (i + np.float32(0.5)) - np.float32(0.5)


def _nearest_matrix(in_size, out_size, scale, exact):
    s = np.float32(1.0 / scale if scale is not None and scale > 0 else in_size / out_size)
    i = np.arange(out_size, dtype=np.float32) + np.float32(0.5 if exact else 0.0)
    src = np.minimum((i * s).astype(np.int64), in_size - 1)
    m = np.zeros((out_size, in_size), np.float32)
    m[np.arange(out_size), src] = 1
    return m


def _linear_matrix(in_size, out_size, align_corners, scale):
    src = np.maximum(_source_index(in_size, out_size, align_corners, scale), np.float32(0))
    lo = np.minimum(src.astype(np.int64), in_size - 1)
    hi = np.minimum(lo + 1, in_size - 1)
    frac = np.clip(src - lo, 0, 1).astype(np.float32)
    m = np.zeros((out_size, in_size), np.float32)
    np.add.at(m, (np.arange(out_size), lo), 1 - frac)
    np.add.at(m, (np.arange(out_size), hi), frac)
    return m


def _cubic_matrix(in_size, out_size, align_corners, scale, a=-0.75):
    src = _source_index(in_size, out_size, align_corners, scale)
    base = np.floor(src)
    t = np.clip(src - base, 0, 1).astype(np.float32)
    near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1  # noqa: E731
    far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # noqa: E731
    weights = (far(t + 1), near(t), near(1 - t), far(2 - t))
    m = np.zeros((out_size, in_size), np.float32)
    for k, w in enumerate(weights):
        idx = np.clip(base.astype(np.int64) - 1 + k, 0, in_size - 1)
        np.add.at(m, (np.arange(out_size), idx), w.astype(np.float32))
    return m


def _resample_transposed(grad, mats):
    """grad (..., out_1, ..., out_n) through each matrix transposed: (..., in_1, ..., in_n)."""
    x = grad.astype(jnp.float32) if grad.dtype in (jnp.float16, jnp.bfloat16) else grad
    n = len(mats)
    for d, m in enumerate(mats):
        axis = x.ndim - n + d
        x = jnp.moveaxis(jnp.tensordot(x, jnp.asarray(m, x.dtype), axes=[[axis], [0]],
                                       precision=lax.Precision.HIGHEST), -1, axis)
    return x.astype(grad.dtype)


def _nearest_backward(grad_output, output_size, input_size, scales, exact):
    spatial = input_size[-len(output_size):]
    mats = [_nearest_matrix(i, o, s, exact) for i, o, s in zip(spatial, output_size, scales)]
    return _resample_transposed(grad_output, mats)


def _linear_backward(grad_output, output_size, input_size, align_corners, scales):
    spatial = input_size[-len(output_size):]
    mats = [_linear_matrix(i, o, align_corners, s) for i, o, s in zip(spatial, output_size, scales)]
    return _resample_transposed(grad_output, mats)


@lower(aten.upsample_nearest1d_backward.default, static_floats=True)
def upsample_nearest1d_backward(grad_output, output_size, input_size, scales=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales,), False)


@lower(aten.upsample_nearest2d_backward.default, static_floats=True)
def upsample_nearest2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales_h, scales_w), False)


@lower(aten.upsample_nearest3d_backward.default, static_floats=True)
def upsample_nearest3d_backward(grad_output, output_size, input_size, scales_d=None, scales_h=None, scales_w=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales_d, scales_h, scales_w), False)


@lower(aten._upsample_nearest_exact1d_backward.default, static_floats=True)
def upsample_nearest_exact1d_backward(grad_output, output_size, input_size, scales=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales,), True)


@lower(aten._upsample_nearest_exact2d_backward.default, static_floats=True)
def upsample_nearest_exact2d_backward(grad_output, output_size, input_size, scales_h=None, scales_w=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales_h, scales_w), True)


@lower(aten._upsample_nearest_exact3d_backward.default, static_floats=True)
def upsample_nearest_exact3d_backward(grad_output, output_size, input_size, scales_d=None, scales_h=None,
                                      scales_w=None):
    return _nearest_backward(grad_output, output_size, input_size, (scales_d, scales_h, scales_w), True)


@lower(aten.upsample_linear1d_backward.default, static_floats=True)
def upsample_linear1d_backward(grad_output, output_size, input_size, align_corners, scales=None):
    return _linear_backward(grad_output, output_size, input_size, align_corners, (scales,))


@lower(aten.upsample_bilinear2d_backward.default, static_floats=True)
def upsample_bilinear2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    return _linear_backward(grad_output, output_size, input_size, align_corners, (scales_h, scales_w))


@lower(aten.upsample_trilinear3d_backward.default, static_floats=True)
def upsample_trilinear3d_backward(grad_output, output_size, input_size, align_corners, scales_d=None,
                                  scales_h=None, scales_w=None):
    return _linear_backward(grad_output, output_size, input_size, align_corners, (scales_d, scales_h, scales_w))


@lower(aten.upsample_bicubic2d_backward.default, static_floats=True)
def upsample_bicubic2d_backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    spatial = input_size[-2:]
    mats = [_cubic_matrix(i, o, align_corners, s) for i, o, s in zip(spatial, output_size, (scales_h, scales_w))]
    return _resample_transposed(grad_output, mats)


@lower(aten._upsample_bilinear2d_aa_backward.default, static_floats=True)
def upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners, scales_h=None,
                                    scales_w=None):
    mats = [_aa_weights(i, o, align_corners, s, _aa_linear, 2)
            for i, o, s in zip(input_size[-2:], output_size, (scales_h, scales_w))]
    return _resample_transposed(grad_output, mats)


@lower(aten._upsample_bicubic2d_aa_backward.default, static_floats=True)
def upsample_bicubic2d_aa_backward(grad_output, output_size, input_size, align_corners, scales_h=None,
                                   scales_w=None):
    mats = [_aa_weights(i, o, align_corners, s, _aa_cubic, 4)
            for i, o, s in zip(input_size[-2:], output_size, (scales_h, scales_w))]
    return _resample_transposed(grad_output, mats)
