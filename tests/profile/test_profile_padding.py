"""The TPU tiling-waste arithmetic, against cases worked out by hand for each generation."""

from __future__ import annotations

import pytest

from tpu_agent.backend.core.generations import GENERATIONS
from tpu_agent.profilers import padding
from tpu_agent.profilers.padding import Tiling, conv_waste, dot_waste, matmul_waste


def test_mxu_edges_per_generation():
    assert {name: Tiling.of(name).mxu for name in GENERATIONS} == {
        "v4": 128, "v5e": 128, "v5p": 128, "v6e": 256, "v7x": 256,
    }


@pytest.mark.parametrize(("bits", "rows"), [(32, 8), (16, 16), (8, 32)])
def test_sublanes_by_element_width(bits, rows):
    assert padding.sublanes(bits) == rows


# (generation, bits, (m, k, n), padded (m, k, n), useful multiply-adds, padded multiply-adds), by hand:
HAND = [
    # v4, f32: 127 -> 128 (8 sublanes), 1023 -> 1024 and 2047 -> 2048 (MXU 128).
    ("v4", 32, (127, 1023, 2047), (128, 1024, 2048), 265_948_287, 268_435_456),
    # v5e, bf16: 100 -> 112 (16 sublanes), 200 -> 256, 300 -> 384.
    ("v5e", 16, (100, 200, 300), (112, 256, 384), 6_000_000, 11_010_048),
    # v5p, int8: 20 -> 32 (32 sublanes); 128 x 128 already fill the MXU.
    ("v5p", 8, (20, 128, 128), (32, 128, 128), 327_680, 524_288),
    # v6e, f32: K = 128 is half of a 256 MXU.
    ("v6e", 32, (8, 128, 256), (8, 256, 256), 262_144, 524_288),
    # v7x, bf16: 300 -> 512 and GPT-2's vocabulary 50257 -> 50432 (multiples of 256).
    ("v7x", 16, (16, 300, 50257), (16, 512, 50432), 241_233_600, 413_138_944),
]


@pytest.mark.parametrize(("gen", "bits", "dims", "padded", "useful", "padded_work"), HAND)
def test_matmul_waste_by_hand(gen, bits, dims, padded, useful, padded_work):
    w = matmul_waste(*dims, tiling=Tiling.of(gen), bits=bits)
    assert tuple(d.padded for d in w.dims) == padded
    assert w.useful == useful
    assert w.padded == padded_work
    assert w.waste == pytest.approx(1 - useful / padded_work, rel=1e-12)


def test_aligned_matmul_wastes_nothing():
    for gen in GENERATIONS:
        w = matmul_waste(256, 512, 1024, tiling=Tiling.of(gen))
        assert w.waste == 0.0
        assert w.attribution() == {}


def test_attribution_splits_the_waste_by_each_dims_padding():
    # K and N both double (64 -> 128) on v5e: each carries half of the 3/4 wasted.
    w = matmul_waste(128, 64, 64, tiling=Tiling.of("v5e"))
    assert w.waste == pytest.approx(0.75)
    shares = w.attribution()
    assert set(shares) == {"K", "N"}
    assert shares["K"] == pytest.approx(shares["N"])
    assert sum(shares.values()) == pytest.approx(w.padded - w.useful)


def test_dot_rows_spanning_several_dims_pad_only_the_minor_one():
    # A (8, 64, 128) activation against a (128, 50257) head: rows 8 x 64 (64 is a multiple of 8),
    # contracted 128, columns 50257 -> 50304 on v5e.
    w = dot_waste((8, 64, 128), (128, 50257), (2,), (0,), tiling=Tiling.of("v5e"))
    m, k, n = w.dims
    assert (m.size, m.padded, k.padded, n.padded) == (512, 512, 128, 50304)
    assert w.waste == pytest.approx(47 / 50304)
    # 7 rows per batch element: each element's rows pad to 8 separately.
    w = dot_waste((8, 7, 128), (128, 128), (2,), (0,), tiling=Tiling.of("v5e"))
    assert w.dims[0].padded == 8 * 8


def test_batched_dot_counts_batch_as_repeats():
    # Attention scores: (32 heads x batch, 64, 32) @ (32, 32, 64): K = 32 -> 128, N = 64 -> 128.
    w = dot_waste((32, 64, 32), (32, 32, 64), (2,), (1,), (0,), (0,), tiling=Tiling.of("v4"))
    assert w.repeats == 32
    assert w.waste == pytest.approx(1 - (64 * 32 * 64) / (64 * 128 * 128))


def test_convolution_features_fill_the_mxu():
    # 3 input channels to 16 output channels, 3x3 window, batch 32 at 32x32: K 3 -> 128, N 16 -> 128.
    w = conv_waste(32, (32, 32), 3, 16, (3, 3), tiling=Tiling.of("v5e"))
    assert w.waste == pytest.approx(1 - 48 / (128 * 128))
    assert w.useful == 32 * 32 * 32 * 3 * 16 * 9
    # The same on v6e (MXU 256): 3 -> 256, 16 -> 256.
    w = conv_waste(32, (32, 32), 3, 16, (3, 3), tiling=Tiling.of("v6e"))
    assert w.waste == pytest.approx(1 - 48 / (256 * 256))


def test_grouped_convolution_pads_each_group():
    # Depthwise: 32 groups of 1 input and 1 output feature.
    w = conv_waste(8, (16, 16), 1, 32, (3, 3), groups=32, tiling=Tiling.of("v5e"))
    assert w.repeats == 32 * 9
    assert w.waste == pytest.approx(1 - 1 / (128 * 128))
