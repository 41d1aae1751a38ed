"""Order statistics, histograms, searching: median, mode, searchsorted, bucketize, histograms,
equal/allclose, segment reductions, hash_tensor (the plain reductions: reduction.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from ..core.registry import lower
from ._util import norm_dim, norm_dims

aten = torch.ops.aten


def _median(self, dim, keepdim, ignore_nan):
    """The lower median along `dim` and its index (stable sort: ties resolve to the
    occurrence PyTorch's CPU kernel returns for sorted runs). NaN propagates unless ignored."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    x = jnp.moveaxis(self, d, -1)
    n = x.shape[-1]
    order = jnp.argsort(x, axis=-1, stable=True)  # NaNs sort last
    nans = jnp.sum(jnp.isnan(x), axis=-1) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape[:-1], jnp.int64)
    if ignore_nan:
        k = jnp.maximum(n - nans - 1, 0) // 2
    else:
        # Any NaN: the median is NaN, at the first NaN's position in the sorted order.
        k = jnp.where(nans > 0, n - nans, (n - 1) // 2)
    k = jnp.minimum(k, n - 1)[..., None]
    idx = jnp.take_along_axis(order, k, axis=-1)
    values = jnp.take_along_axis(x, idx, axis=-1)
    values, idx = jnp.moveaxis(values, -1, d), jnp.moveaxis(idx, -1, d)
    if not keepdim:
        values, idx = jnp.squeeze(values, d), jnp.squeeze(idx, d)
    return values, idx.astype(jnp.int64)


@lower(aten.median.default)
def median(self):
    if self.size == 0:
        return jnp.asarray(jnp.nan, self.dtype)
    return _median(self.reshape(-1), 0, False, False)[0]


@lower(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, False)


@lower(aten.nanmedian.default)
def nanmedian(self):
    if self.size == 0:
        return jnp.asarray(jnp.nan, self.dtype)
    return _median(self.reshape(-1), 0, False, True)[0]


@lower(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, True)


@lower(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """The most frequent value (the smallest among equally frequent ones) and its last index."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, self.ndim)
    x = jnp.moveaxis(self, d, -1)
    n = x.shape[-1]
    s = jnp.sort(x, axis=-1)
    # The length of the run of equal values ending at each sorted position; the first
    # maximum ends the longest run of the smallest such value.
    positions = jnp.arange(n)
    starts = jnp.concatenate([jnp.ones(s.shape[:-1] + (1,), bool), s[..., 1:] != s[..., :-1]], axis=-1)
    run_start = lax.cummax(jnp.where(starts, positions, 0), axis=s.ndim - 1)
    best = jnp.argmax(positions - run_start, axis=-1)[..., None]
    values = jnp.take_along_axis(s, best, axis=-1)
    idx = jnp.max(jnp.where(x == values, positions, -1), axis=-1, keepdims=True)
    values, idx = jnp.moveaxis(values, -1, d), jnp.moveaxis(idx, -1, d)
    if not keepdim:
        values, idx = jnp.squeeze(values, d), jnp.squeeze(idx, d)
    return values, idx.astype(jnp.int64)


def _search_side(right, side):
    if side is not None:
        return side
    return "right" if right else "left"


@lower(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    side = _search_side(right, side)
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    values = jnp.asarray(self)
    out_dtype = jnp.int32 if out_int32 else jnp.int64
    if seq.ndim == 1:
        return jnp.searchsorted(seq, values, side=side).astype(out_dtype)
    lead = seq.shape[:-1]
    flat_seq = seq.reshape((-1, seq.shape[-1]))
    flat_vals = values.reshape((flat_seq.shape[0], -1))
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(flat_seq, flat_vals)
    return out.reshape(lead + values.shape[len(lead):]).astype(out_dtype)


@lower(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    out = jnp.searchsorted(boundaries, jnp.asarray(self), side="right" if right else "left")
    return out.astype(jnp.int32 if out_int32 else jnp.int64)


def _histogram_counts(x, edges, weight, local_search):
    """Counts of x in the bins given by `edges` (the last bin is closed), PyTorch's way:
    a linear estimate of the bin, corrected against the edges when `local_search`."""
    bins = edges.shape[0] - 1
    lo, hi = edges[0], edges[-1]
    pos = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.clip(pos, 0, bins - 1)
    if local_search:
        pos = jnp.where(edges[pos] > x, pos - 1, jnp.where(edges[jnp.minimum(pos + 1, bins)] <= x, pos + 1, pos))
        pos = jnp.clip(pos, 0, bins - 1)
    inside = (x >= lo) & (x <= hi)
    w = jnp.ones_like(x) if weight is None else weight.astype(x.dtype)
    w = jnp.where(inside, w, 0)
    return jnp.zeros((bins,), x.dtype).at[pos].add(w)


@lower(aten.histc.default)
def histc(self, bins=100, min=0, max=0):
    x = self.reshape(-1)
    lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    if x.size:
        same = lo == hi
        lo, hi = jnp.where(same, jnp.min(x), lo), jnp.where(same, jnp.max(x), hi)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    edges = jnp.linspace(lo, hi, bins + 1, dtype=x.dtype)
    return _histogram_counts(x, edges, None, local_search=False)


@lower(aten.histogram.bin_ct)
def histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    x = self.reshape(-1)
    if range is not None:
        lo, hi = jnp.asarray(range[0], x.dtype), jnp.asarray(range[1], x.dtype)
    elif x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    else:
        lo, hi = jnp.asarray(0, x.dtype), jnp.asarray(0, x.dtype)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    edges = jnp.linspace(lo, hi, bins + 1, dtype=x.dtype)
    hist = _histogram_counts(x, edges, None if weight is None else weight.reshape(-1), local_search=True)
    if density:
        hist = hist / (jnp.sum(hist) * jnp.diff(edges))
    return hist, edges


@lower(aten.histogram.bins_tensor)
def histogram_bins_tensor(self, bins, *, weight=None, density=False):
    x = self.reshape(-1)
    nb = bins.shape[0] - 1
    pos = jnp.searchsorted(bins, x, side="right") - 1
    pos = jnp.where(x == bins[-1], nb - 1, pos)
    inside = (x >= bins[0]) & (x <= bins[-1])
    w = jnp.ones_like(x) if weight is None else weight.reshape(-1).astype(x.dtype)
    hist = jnp.zeros((nb,), x.dtype).at[jnp.clip(pos, 0, nb - 1)].add(jnp.where(inside, w, 0))
    if density:
        hist = hist / (jnp.sum(hist) * jnp.diff(bins))
    return hist, bins


@lower(aten.equal.default)
def equal(self, other):
    if self.shape != other.shape:
        return jnp.asarray(False)
    return jnp.all(self == other)


@lower(aten.allclose.default)
def allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    return jnp.all(jnp.isclose(self, other, rtol=rtol, atol=atol, equal_nan=equal_nan))


@lower(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    if indices is not None:
        raise NotImplementedError("segment_reduce with indices")
    axis = norm_dim(axis, data.ndim)
    if lengths is None:
        lengths = jnp.diff(offsets, axis=-1)
    n = data.shape[axis]
    segments = lengths.shape[-1]
    lead = data.shape[:axis]

    def one(d, lens):
        ids = jnp.repeat(jnp.arange(segments), lens, total_repeat_length=n)
        ops = {"sum": jax.ops.segment_sum, "mean": jax.ops.segment_sum, "max": jax.ops.segment_max,
               "min": jax.ops.segment_min, "prod": jax.ops.segment_prod}
        out = ops[reduce](d, ids, num_segments=segments)
        shape = (segments,) + (1,) * (d.ndim - 1)
        empty = (lens == 0).reshape(shape)
        # `initial` starts every segment's reduction, empty or not.
        if initial is not None:
            combine = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum,
                       "prod": jnp.multiply}[reduce]
            out = combine(out, jnp.asarray(initial, out.dtype))
        if reduce == "mean":
            out = out / jnp.maximum(lens, 1).reshape(shape).astype(out.dtype)
        default = {"sum": 0, "mean": jnp.nan, "max": -jnp.inf, "min": jnp.inf, "prod": 1}[reduce]
        return jnp.where(empty, default if initial is None else initial, out).astype(d.dtype)

    moved = jnp.moveaxis(data, axis, len(lead))
    flat = moved.reshape((-1,) + moved.shape[len(lead):])
    out = jax.vmap(one)(flat, lengths.reshape((-1, segments)))
    out = out.reshape(lead + out.shape[1:])
    return out


def _histogramdd_edges(self, bins, range):
    """Equal-width edges per dimension of the last axis of `self` (N points in D dims)."""
    x = self.reshape(-1, self.shape[-1])
    edges = []
    for d, nb in enumerate(bins):
        if range is not None:
            lo, hi = jnp.asarray(range[2 * d], x.dtype), jnp.asarray(range[2 * d + 1], x.dtype)
        elif x.shape[0]:
            lo, hi = jnp.min(x[:, d]), jnp.max(x[:, d])
        else:
            lo, hi = jnp.asarray(0, x.dtype), jnp.asarray(0, x.dtype)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        edges.append(jnp.linspace(lo, hi, nb + 1, dtype=x.dtype))
    return edges


def _histogramdd(self, edges, weight, density, uniform):
    x = self.reshape(-1, self.shape[-1])
    n = x.shape[0]
    flat = jnp.zeros((n,), jnp.int64)
    inside = jnp.ones((n,), bool)
    for d, e in enumerate(edges):
        nb = e.shape[0] - 1
        v = x[:, d]
        if uniform:
            pos = jnp.clip(jnp.floor((v - e[0]) * nb / (e[-1] - e[0])).astype(jnp.int64), 0, nb - 1)
            pos = jnp.where(e[pos] > v, pos - 1, jnp.where(e[jnp.minimum(pos + 1, nb)] <= v, pos + 1, pos))
        else:
            pos = jnp.searchsorted(e, v, side="right") - 1
            pos = jnp.where(v == e[-1], nb - 1, pos)
        pos = jnp.clip(pos, 0, nb - 1)
        inside = inside & (v >= e[0]) & (v <= e[-1])
        flat = flat * nb + pos
    shape = tuple(e.shape[0] - 1 for e in edges)
    w = jnp.ones((n,), x.dtype) if weight is None else weight.reshape(-1).astype(x.dtype)
    hist = jnp.zeros((int(np.prod(shape)),), x.dtype).at[flat].add(jnp.where(inside, w, 0)).reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            widths = jnp.diff(e).reshape((1,) * d + (-1,) + (1,) * (len(edges) - d - 1))
            hist = hist / widths
    return hist


@lower(aten._histogramdd_bin_edges.default)
def histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    return _histogramdd_edges(self, bins, range)


@lower(aten._histogramdd_from_bin_cts.default)
def histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    return _histogramdd(self, _histogramdd_edges(self, bins, range), weight, density, uniform=True)


@lower(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    return _histogramdd(self, list(bins), weight, density, uniform=False)


@lower(aten._segment_reduce_backward.default)
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """PyTorch's gradient of segment_reduce: sum and mean spread the segment's gradient (mean
    divided by its length); max and min share it among the elements equal to the result;
    prod gives each element the product of the others (a segment's only zero gets it all)."""
    axis = norm_dim(axis, data.ndim)
    if lengths is None:
        lengths = jnp.diff(offsets, axis=-1)
    n = data.shape[axis]
    segments = lengths.shape[-1]
    lead = data.shape[:axis]

    def one(d, g, o, lens):
        ids = jnp.repeat(jnp.arange(segments), lens, total_repeat_length=n)
        g_e, o_e = g[ids], o[ids]
        if reduce == "sum":
            return g_e
        if reduce == "mean":
            return g_e / jnp.maximum(lens, 1)[ids].reshape((-1,) + (1,) * (d.ndim - 1)).astype(g.dtype)
        if reduce in ("max", "min"):
            hit = d == o_e
            count = jax.ops.segment_sum(hit.astype(g.dtype), ids, num_segments=segments)[ids]
            return jnp.where(hit, g_e / jnp.where(hit, count, 1), 0)
        zero = d == 0
        zeros = jax.ops.segment_sum(zero.astype(jnp.int32), ids, num_segments=segments)[ids]
        rest = jax.ops.segment_prod(jnp.where(zero, 1, d), ids, num_segments=segments)[ids]
        if initial is not None:
            rest = rest * jnp.asarray(initial, d.dtype)
        others = jnp.where(zeros == 0, o_e / jnp.where(zero, 1, d), jnp.where((zeros == 1) & zero, rest, 0))
        return g_e * others

    def flat(x):
        moved = jnp.moveaxis(x, axis, len(lead))
        return moved.reshape((-1,) + moved.shape[len(lead):])

    out = jax.vmap(one)(flat(data), flat(grad), flat(output), lengths.reshape((-1, segments)))
    out = out.reshape(lead + out.shape[1:])
    return jnp.moveaxis(out, len(lead), axis).astype(data.dtype)


@lower(aten.hash_tensor.default)
def hash_tensor(self, dim=(), *, keepdim=False, mode=0):
    """mode 0, PyTorch's only one: the XOR of the elements' 64-bit patterns, floats read as
    float64 and integers as int64 first, as uint64. (Needs uint64 on the device.)"""
    if mode != 0:
        raise NotImplementedError(f"hash_tensor mode {mode}")
    wide = jnp.float64 if jnp.issubdtype(self.dtype, jnp.floating) else jnp.int64
    bits = lax.bitcast_convert_type(self.astype(wide), jnp.uint64)
    axes = norm_dims(dim, self.ndim)
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, axes)
    return jnp.expand_dims(out, axes) if keepdim else out
