"""A TPU slice named as Cloud TPU names it (`v5p-256`, `v6e-256`): its generation, chips, torus shape; meshes on it."""

from __future__ import annotations

import math

from pydantic import BaseModel

from tpu_agent.backend.generations import GENERATIONS
from tpu_agent.errors import InputError
from tpu_agent.profilers.topology import INTERCONNECTS

ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "tpu7x": "v7x", "v7": "v7x", "v6": "v6e"}
TWO_D = (1, 4, 8, 16, 32, 64, 128, 256)  # v5e/v6e slice sizes: 1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16


class Slice(BaseModel):
    name: str
    generation: str
    chips: int
    torus: tuple[int, ...]  # chips along each torus dim, dim 0 varying fastest with the device id
    wraparound: tuple[bool, ...]


def _three_d(chips: int) -> tuple[int, ...] | None:
    """The most cubic AxBxC (each a power of two, 4 or more past one cube) holding `chips`, else None."""
    if chips in (1, 2, 4, 8, 16, 32):
        return {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 16: (4, 2, 2), 32: (4, 4, 2)}[chips]
    if chips % 64:
        return None
    best = None
    for a in range(4, chips + 1, 4):
        for b in range(a, chips // a + 1, 4):
            if (chips // a) % b or (chips // a // b) % 4 or chips // a // b < b:
                continue
            shape = (a, b, chips // a // b)
            if best is None or max(shape) - min(shape) < max(best) - min(best):
                best = shape
    return best


def parse(text: str) -> Slice:
    kind, dash, count = text.strip().lower().rpartition("-")
    kind = ALIASES.get(kind, kind)
    if not dash or kind not in INTERCONNECTS or not count.isdigit():
        known = ", ".join(f"{g}-N" for g in INTERCONNECTS)
        raise InputError(f"--target {text!r}: expected a slice such as v5p-256 or v6e-256 ({known})")
    ic = INTERCONNECTS[kind]
    n = int(count)
    chips = n // ic.cores_per_chip if ic.name_counts_cores else n
    if ic.name_counts_cores and n % ic.cores_per_chip:
        raise InputError(f"--target {text!r}: {kind} slices are named by TensorCores ({ic.cores_per_chip} per chip); "
                         f"{n} is not a multiple of {ic.cores_per_chip}")
    if ic.torus_dims == 2:
        if n not in TWO_D:
            raise InputError(f"--target {text!r}: {kind} offers slices of {', '.join(map(str, TWO_D))} chips, not {n}")
        side = 2 ** math.ceil(math.log2(chips) / 2) if chips > 1 else 1
        torus = (side, chips // side)
        wrap = tuple(d >= ic.wraparound_from for d in torus)
    else:
        torus = _three_d(chips) if 0 < chips <= ic.max_chips else None
        if torus is None:
            raise InputError(f"--target {text!r}: {kind} offers no slice of {chips} chips (up to {ic.max_chips}; "
                             "past 32 chips, whole 4x4x4 cubes: a multiple of 64 chips)")
        wrap = tuple(d >= ic.wraparound_from for d in torus)
    return Slice(name=f"{kind}-{n}", generation=kind, chips=chips, torus=torus, wraparound=wrap)


def parse_mesh(text: str, chips: int) -> dict[str, int]:
    """`data=16,fsdp=16` -> {"data": 16, "fsdp": 16}; the product must be the slice's chip count."""
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not name.strip() or not size.strip().isdigit() or int(size) < 1:
            raise InputError(f"--mesh {text!r}: expected NAME=SIZE pairs, e.g. --mesh data=16,fsdp=16")
        axes[name.strip()] = int(size)
    check_mesh(axes, chips, f"--mesh {text!r}")
    return axes


def check_mesh(axes: dict[str, int], chips: int, what: str) -> None:
    if math.prod(axes.values()) != chips:
        raise InputError(f"{what}: the mesh's product is {math.prod(axes.values())}, the slice has {chips} chips")


def peak(generation: str) -> float:
    return GENERATIONS[generation].peak_bf16_flops
