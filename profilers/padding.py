"""TPU tiling waste of one matmul or convolution: the arithmetic behind the padding report.

A model, not a measurement. For (M x K) @ (K x N): K and N fill the MXU, so
they pad to its edge (128 on v4/v5e/v5p, 256 on v6e/v7x); M, the rows
streamed through it, is a second-minor dim and pads to the sublane count
(8 for 32-bit, 16 for 16-bit, 32 for 8-bit types). A role spanning several
array dims pads only its minor-most one. A convolution is that matmul per
group and kernel position. Work is in multiply-adds; waste = 1 - useful / padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpu_agent.backend.core.generations import GENERATIONS, Generation

LANE = 128


def sublanes(bits: int) -> int:
    """Rows per tile for an element type of this width (8 for 32-bit, 16 for 16-bit, 32 for 8-bit)."""
    if bits <= 8:
        return 32
    if bits <= 16:
        return 16
    return 8


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple if size > 0 else 0


@dataclass(frozen=True)
class Tiling:
    generation: str
    mxu: int

    @classmethod
    def of(cls, generation: str | Generation) -> "Tiling":
        gen = GENERATIONS[generation] if isinstance(generation, str) else generation
        return cls(gen.name, gen.mxu)

    def multiple(self, role: str, bits: int) -> int:
        """What a dim in this role is padded to: K and N to the MXU edge, M to the sublane count."""
        if role == "M":
            return sublanes(bits)
        return max(self.mxu, LANE)


@dataclass(frozen=True)
class Dim:
    """One role of a matmul: its minor-most array dim is padded, `outer` multiplies it unpadded."""

    role: str  # "M" rows, "K" contracted, "N" output columns
    minor: int
    multiple: int
    outer: int = 1

    @property
    def size(self) -> int:
        return self.outer * self.minor

    @property
    def padded(self) -> int:
        return self.outer * round_up(self.minor, self.multiple)

    @property
    def aligned(self) -> bool:
        return self.minor % self.multiple == 0

    @property
    def waste(self) -> float:
        """Share of the padded work this dim alone wastes."""
        return 1.0 - self.size / self.padded if self.padded else 0.0


@dataclass(frozen=True)
class MatmulWaste:
    dims: tuple[Dim, Dim, Dim]  # M, K, N
    repeats: int = 1  # batch dims x groups x kernel window positions: multiply both sides

    @property
    def useful(self) -> int:
        """Multiply-adds the operation needs."""
        return self.repeats * math.prod(d.size for d in self.dims)

    @property
    def padded(self) -> int:
        """Multiply-adds the TPU performs once every dim is padded to its tile."""
        return self.repeats * math.prod(d.padded for d in self.dims)

    @property
    def waste(self) -> float:
        return 1.0 - self.useful / self.padded if self.padded else 0.0

    def attribution(self) -> dict[str, float]:
        """Wasted multiply-adds shared among the unaligned dims, by each one's log padding ratio.

        The shares add up to `padded - useful`; a dim alone that doubles the work
        gets the same share as another alone that doubles it.
        """
        wasted = self.padded - self.useful
        logs = {d.role: math.log(d.padded / d.size) for d in self.dims if d.size and not d.aligned}
        total = sum(logs.values())
        if wasted <= 0 or total <= 0:
            return {}
        return {role: wasted * value / total for role, value in logs.items()}


def matmul_waste(
    m: int, k: int, n: int, *, tiling: Tiling, bits: int = 32,
    m_outer: int = 1, k_outer: int = 1, n_outer: int = 1, repeats: int = 1,
) -> MatmulWaste:
    """Waste of `repeats` matmuls of (m_outer*m x k_outer*k) @ (k_outer*k x n_outer*n)."""
    return MatmulWaste(
        (
            Dim("M", m, tiling.multiple("M", bits), m_outer),
            Dim("K", k, tiling.multiple("K", bits), k_outer),
            Dim("N", n, tiling.multiple("N", bits), n_outer),
        ),
        repeats,
    )


def dot_waste(lhs: tuple[int, ...], rhs: tuple[int, ...], lhs_contracting, rhs_contracting,
              lhs_batch=(), rhs_batch=(), *, tiling: Tiling, bits: int = 32) -> MatmulWaste:
    """Waste of an HLO `dot` from its operand shapes and dimension numbers."""
    lhs_free = [i for i in range(len(lhs)) if i not in lhs_contracting and i not in lhs_batch]
    rhs_free = [i for i in range(len(rhs)) if i not in rhs_contracting and i not in rhs_batch]
    contracting = sorted(lhs_contracting)

    def split(shape, dims):
        if not dims:
            return 1, 1
        return shape[dims[-1]], math.prod(shape[d] for d in dims[:-1])

    m, m_outer = split(lhs, lhs_free)
    k, k_outer = split(lhs, contracting)
    n, n_outer = split(rhs, rhs_free)
    batch = math.prod(lhs[d] for d in lhs_batch)
    return matmul_waste(m, k, n, tiling=tiling, bits=bits, m_outer=m_outer, k_outer=k_outer,
                        n_outer=n_outer, repeats=batch)


def conv_waste(out_batch: int, out_spatial: tuple[int, ...], in_features_per_group: int,
               out_features: int, window: tuple[int, ...], groups: int = 1, *,
               tiling: Tiling, bits: int = 32) -> MatmulWaste:
    """Waste of a convolution seen as one matmul per group and kernel window position."""
    rows = out_batch * math.prod(out_spatial)
    per_group_out = out_features // groups if groups and out_features % groups == 0 else out_features
    return matmul_waste(rows, in_features_per_group, per_group_out, tiling=tiling, bits=bits,
                        repeats=groups * math.prod(window))
