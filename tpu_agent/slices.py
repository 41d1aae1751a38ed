"""A TPU slice named as Cloud TPU names it (`v5p-256`, `v6e-256`): its generation, chips, torus shape; meshes on it."""

from __future__ import annotations

import math
import re

from pydantic import BaseModel

from tpu_agent.backend.core.generations import GENERATIONS
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
    cores: int = 0  # TensorCores (JAX devices on v4/v5p/v7x: 2 per chip); 0 when not read
    read_as: str = ""  # how the input was read, in words (the tool says it)
    slices: int = 1  # slices of `chips` each, joined by the data-center network (multislice); chips: one slice's

    @property
    def total_chips(self) -> int:
        return self.chips * self.slices


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


def _described(sl: Slice, text: str, how: str) -> Slice:
    ic = INTERCONNECTS[sl.generation]
    cores = sl.chips * ic.cores_per_chip
    devices = (f", {cores} TensorCores ({ic.cores_per_chip} per chip, each a JAX device)" if ic.cores_per_chip > 1
               else " (one TensorCore each)")
    read = (f"read {text!r} as {how}: {sl.chips} chips{devices}, a {'x'.join(map(str, sl.torus))} torus; "
            f"named {sl.name}")
    return sl.model_copy(update={"cores": cores, "read_as": read})


def from_topology(text: str) -> Slice | None:
    """`tpu7x-4x4x4`, `v5p-4x4x8`, `v6e-16x16`: the slice by its chip topology (as GKE and xpk name it), else None."""
    kind, dash, dims = text.strip().lower().partition("-")
    kind = ALIASES.get(kind, kind)
    parts = dims.split("x")
    if not dash or kind not in INTERCONNECTS or len(parts) < 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    ic = INTERCONNECTS[kind]
    shape = tuple(int(p) for p in parts)
    if len(shape) != ic.torus_dims:
        raise InputError(f"--target {text!r}: {kind} slices are {ic.torus_dims}-D ({'x'.join('N' * ic.torus_dims)})")
    chips = math.prod(shape)
    sl = parse(f"{kind}-{chips * ic.cores_per_chip if ic.name_counts_cores else chips}")
    if sorted(shape) != sorted(sl.torus):
        sl = sl.model_copy(update={"torus": shape, "wraparound": tuple(d >= ic.wraparound_from for d in shape)})
    else:
        sl = sl.model_copy(update={"torus": shape})
    return _described(sl, text, "a chip topology")


def from_chips(generation: str, chips: int) -> Slice:
    """`--target v7x --chips 64`: the generation's slice of that many chips."""
    kind = ALIASES.get(generation.strip().lower(), generation.strip().lower())
    if kind not in INTERCONNECTS:
        raise InputError(f"--target {generation!r} with --chips: expected a generation ({', '.join(INTERCONNECTS)})")
    if chips < 1:
        raise InputError(f"--chips {chips}: give 1 or more chips")
    ic = INTERCONNECTS[kind]
    sl = parse(f"{kind}-{chips * ic.cores_per_chip if ic.name_counts_cores else chips}")
    return _described(sl, f"{generation} --chips {chips}", "a chip count")


def multislice(sl: Slice, count: int) -> Slice:
    """`--slices N`: N copies of the slice, joined by DCN (data parallel across them, as MaxText's
    dcn_data_parallelism)."""
    if count < 1:
        raise InputError(f"--slices {count}: give 1 or more slices")
    if count == 1:
        return sl
    if sl.slices > 1:
        raise InputError(f"--slices {count}: {sl.name} already names {sl.slices} slices")
    return sl.model_copy(update={"slices": count, "name": f"{count}x{sl.name}",
                                 "read_as": f"{sl.read_as}; {count} such slices joined by DCN: {count * sl.chips} chips"})


def in_slice_mesh(mesh: dict[str, int], sl: Slice) -> dict[str, int]:
    """The mesh of one slice: across slices only the `data` axis runs (DCN data parallelism), so `data` must divide
    by the slice count; one slice is traced and the gradients' all-reduce across slices added by the cost model."""
    if sl.slices == 1:
        return dict(mesh)
    if mesh.get("data", 1) % sl.slices:
        raise InputError(f"--mesh {','.join(f'{k}={v}' for k, v in mesh.items())}: across {sl.slices} slices only the "
                         f"data axis runs over DCN; give data as a multiple of {sl.slices}")
    inner = {k: (v // sl.slices if k == "data" else v) for k, v in mesh.items()}
    return {k: v for k, v in inner.items() if v > 1} or {"fsdp": 1}


def read(target: str, chips: int | None = None) -> Slice:
    """Any of the three ways to name a slice: the generation's own name (`v7x-128`: TensorCores on v4/v5p/v7x,
    chips on v5e/v6e), a topology (`tpu7x-4x4x4`), or a generation with `--chips`; the slice says which it read.
    `NxSLICE` (`32xtpu7x-4x8x8`, as a multislice projection names itself) is N such slices joined by DCN."""
    several = re.fullmatch(r"(\d+)x([a-z].*)", target.strip().lower())
    if several:
        return multislice(read(several.group(2), chips), int(several.group(1)))
    if chips is not None:
        if "-" in target.strip():
            sl = read(target)
            if sl.chips != chips:
                raise InputError(f"--target {target!r} has {sl.chips} chips, --chips says {chips}")
            return sl
        return from_chips(target, chips)
    topology = from_topology(target)
    if topology is not None:
        return topology
    ic = INTERCONNECTS.get(ALIASES.get(target.strip().lower().rpartition("-")[0], target.strip().lower().rpartition("-")[0]))
    how = ("the generation's name, counting TensorCores" if ic is not None and ic.name_counts_cores
           else "the generation's name, counting chips")
    return _described(parse(target), target, how)


def parse(text: str) -> Slice:
    kind, dash, count = text.strip().lower().rpartition("-")
    kind = ALIASES.get(kind, kind)
    if not dash or kind not in INTERCONNECTS or not count.isdigit():
        known = ", ".join(f"{g}-N" for g in INTERCONNECTS)
        raise InputError(f"--target {text!r}: expected a slice such as v5p-256, v6e-256, tpu7x-4x4x4 or a generation "
                         f"with --chips ({known})")
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
