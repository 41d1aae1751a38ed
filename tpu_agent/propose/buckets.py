"""Bucket lengths for batches whose length changes: few programs, little padding.

Each bucket is one program to compile; each token of padding is work done
for nothing. From the lengths a profile saw, the best k buckets (least
padding over those batches) are found exactly by dynamic programming over
the observed lengths rounded up to the tile: short sequences to 8 rows (a
32-bit tile's sublanes), long ones to 128 (its lanes), so that a bucket is
also an aligned dim.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpu_agent.profilers.padding import round_up
from tpu_agent.profilers.recompile_schema import VaryingDim
from tpu_agent.profilers.schema import Profile

BUCKET_COUNTS = (1, 2, 4)  # one fixed length, and two ways to trade programs for padding
LONG = 256  # from this length on, buckets are multiples of 128


def tile_for(lengths: Sequence[int]) -> int:
    return 128 if max(lengths) >= LONG else 8


def best_buckets(lengths: Sequence[int], count: int, multiple: int) -> tuple[int, ...]:
    """The `count` (or fewer) bucket lengths, multiples of `multiple`, that pad `lengths` least in total."""
    points = sorted({round_up(n, multiple) for n in lengths})
    if len(points) <= count:
        return tuple(points)
    tally = {p: 0 for p in points}
    total = {p: 0 for p in points}
    for n in lengths:
        p = round_up(n, multiple)
        tally[p] += 1
        total[p] += n

    def waste(lo: int, hi: int) -> int:
        """Padding when points[lo..hi] all pad to points[hi]."""
        return sum(tally[points[i]] * points[hi] - total[points[i]] for i in range(lo, hi + 1))

    inf = float("inf")
    n = len(points)
    # cost[k][j]: least padding of points[0..j] with k buckets, the last at points[j]
    cost = [[inf] * n for _ in range(count + 1)]
    back = [[-1] * n for _ in range(count + 1)]
    for j in range(n):
        cost[1][j] = waste(0, j)
    for k in range(2, count + 1):
        for j in range(n):
            for i in range(j):
                c = cost[k - 1][i] + waste(i + 1, j)
                if c < cost[k][j]:
                    cost[k][j], back[k][j] = c, i
    out, j = [], n - 1
    for k in range(count, 0, -1):
        out.append(points[j])
        j = back[k][j]
        if j < 0:
            break
    return tuple(sorted(out))


def main_dim(profile: Profile) -> VaryingDim | None:
    r = profile.recompiling
    if r is None or not r.batch_dims:
        return None
    return max(r.batch_dims, key=lambda d: len(d.sizes))


def pad_values(profile: Profile) -> dict[str, float]:
    """The tensors to pad with the main varying dim, each with its pad value; empty when one has none."""
    main = main_dim(profile)
    if main is None:
        return {}
    same = [d for d in profile.recompiling.batch_dims if d.dim == main.dim]
    if any(d.pad_value is None for d in same):
        return {}
    return {d.tensor: d.pad_value for d in same}


def declared_max(profile: Profile, dim: int) -> int | None:
    """The largest `max` the script declares for `dim` with mark_dynamic (None: no bound declared)."""
    found = [b.max for b in profile.recompiling.bounds if b.dim == dim and b.max is not None]
    return max(found) if found else None


def bucket_choices(profile: Profile) -> list[tuple[int, ...]]:
    """One fixed length and the best 2 and 4 buckets for the lengths the profile saw, the last covering a max
    the script declares (`mark_dynamic(x, dim, min, max)`)."""
    main = main_dim(profile)
    if main is None:
        return []
    lengths = list(main.by_batch or main.sizes)
    bound = declared_max(profile, main.dim)
    if bound is not None:  # the longest the script says may come: the last bucket covers it, seen or not
        lengths.append(bound)
    multiple = tile_for(lengths)
    out: list[tuple[int, ...]] = []
    for count in BUCKET_COUNTS:
        b = best_buckets(lengths, count, multiple)
        if b not in out:
            out.append(b)
    return out


def pads_seen(profile: Profile) -> bool:
    r = profile.recompiling
    return bool(r) and all(d.pad_value_seen for d in r.batch_dims if d.tensor in pad_values(profile))
