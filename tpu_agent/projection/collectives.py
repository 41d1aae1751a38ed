"""Collectives in a partitioned HLO module: kind, bytes, replica groups, and the mesh axes they run over."""

from __future__ import annotations

import math
import re

import numpy as np

from tpu_agent.profilers import hlo

from .results import Collective

KINDS = {"all-gather": "all-gather", "all-reduce": "all-reduce", "reduce-scatter": "reduce-scatter",
         "all-to-all": "all-to-all", "collective-permute": "collective-permute"}
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def replica_groups(attrs: str, devices: int) -> list[list[int]]:
    """The groups of an instruction's `replica_groups` (explicit `{{0,1},{2,3}}` or iota `[2,2]<=[4]`)."""
    named = _MESH.search(attrs)
    if named:  # `mesh['axis_0'=8,'axis_1'=2] {'axis_0'}`: devices iota over the mesh, grouped along the listed axes
        dims = re.findall(r"'([^']+)'=(\d+)", named.group(1))
        listed = re.findall(r"'([^']+)'", named.group(2))
        names, sizes = [d[0] for d in dims], [int(d[1]) for d in dims]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        inner = [i for i, n in enumerate(names) if n in listed]
        outer = [i for i in range(len(names)) if i not in inner]
        return ids.transpose(outer + inner).reshape(-1, math.prod(sizes[i] for i in inner) if inner else 1).tolist()
    m = re.search(r"replica_groups=(\{\{[^=]*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m is None:
        m = re.search(r"source_target_pairs=\{([^=]*?)\}(?:,|$)", attrs)
        if m is None:
            return [list(range(devices))]
        pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(0))]
        return [list(p) for p in pairs]
    text = m.group(1)
    if text == "{}":
        return [list(range(devices))]
    iota = _IOTA.fullmatch(text)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        dims = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape).tolist()
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def axes_of(group: list[int], mesh: dict[str, int]) -> list[str]:
    """The mesh axes along which the devices of one group differ (the mesh laid out row-major over ids)."""
    names, sizes = list(mesh), list(mesh.values())
    coords = np.array(np.unravel_index(np.array(group), sizes)).T
    return [names[i] for i in range(len(names)) if len(set(coords[:, i].tolist())) > 1]


NARROW = {"bf16": 16, "f16": 16}


def _narrowed_bits(inst: hlo.Instruction, by_name: dict, consumers: dict) -> int | None:
    """XLA:CPU runs bf16 dots in f32 and moves the conversion next to the collective: a f32 collective whose
    operand was converted up from bf16, or whose every consumer converts down to bf16, moves bf16 on a TPU."""
    if not inst.shape or inst.shape[0].dtype != "f32":
        return None
    operand = by_name.get(inst.operands[0]) if inst.operands else None
    if operand is not None and operand.operands:
        inputs = [by_name[o].shape[0].dtype for o in operand.operands if o in by_name and by_name[o].shape]
        if inputs and all(d in NARROW for d in inputs) and ("convert" in operand.name or operand.opcode == "convert"):
            return NARROW[inputs[0]]
    users = consumers.get(inst.name, [])
    if users and all(u.shape and u.shape[0].dtype in NARROW and ("convert" in u.name or u.opcode == "convert")
                     for u in users):
        return NARROW[users[0].shape[0].dtype]
    return None


def _scatters(inst: hlo.Instruction, consumers: dict, group: int) -> bool:
    """An all-reduce whose every consumer keeps 1/group of it (a dynamic slice): a reduce-scatter on a TPU
    (XLA:CPU has no reduce-scatter creator pass)."""
    users = consumers.get(inst.name, [])
    whole = sum(a.elements for a in inst.shape)
    return bool(users) and group > 1 and all(
        u.shape and u.shape[0].elements * group == whole and ("slice" in u.name or u.opcode == "dynamic-slice")
        for u in users)


def _summed_twins(inst: hlo.Instruction, consumers: dict, module: hlo.Module) -> list[int]:
    """Elements of a tuple all-reduce that one consumer adds together, but the first of each such set: XLA:CPU
    all-reduces each partial sum (three for a tensor-parallel q/k/v input gradient) where a TPU compile adds
    them first and all-reduces once (XLA's AllReduceReassociate pass; the CPU pipeline does not run it)."""
    by_user: dict[str, list[int]] = {}
    for gte in consumers.get(inst.name, []):
        index = re.search(r"index=(\d+)", gte.attrs)
        users = consumers.get(gte.name, [])
        if gte.opcode != "get-tuple-element" or index is None or len(users) != 1:
            continue
        user = users[0]
        adds = user.opcode == "add" or any(i.opcode == "add" for c in user.called for i in module.computations.get(c, []))
        if adds:
            by_user.setdefault(user.name, []).append(int(index.group(1)))
    twins = []
    for indices in by_user.values():
        same = [i for i in indices[1:] if i < len(inst.shape) and inst.shape[i].dims == inst.shape[indices[0]].dims]
        twins += same
    return twins


def collectives(module: hlo.Module, mesh: dict[str, int], narrow: int | None = None) -> list[Collective]:
    """`narrow`: the width in bits of the step's own floats when every parameter and optimizer state is of that
    width (bf16: 16): an f32 collective is then XLA:CPU computing that narrow value in f32 (it runs bf16 dots and
    arithmetic in f32) and is counted at the narrow width, as a TPU moves it."""
    devices = math.prod(mesh.values())
    found = []
    for computation, insts in module.computations.items():
        by_name = {i.name: i for i in insts}
        consumers: dict[str, list] = {}
        for i in insts:
            for o in i.operands:
                consumers.setdefault(o, []).append(i)
        for inst in insts:
            op = inst.opcode.removesuffix("-start")
            if op not in KINDS or inst.opcode.endswith("-done"):
                continue
            groups = replica_groups(inst.attrs, devices)
            size = len(groups[0]) if groups else 1
            if op == "collective-permute":
                size = 2
            shapes = inst.shape
            if inst.opcode.endswith("-start") and len(shapes) > 1:
                shapes = shapes[len(shapes) // 2:]  # (operands, results)
            bits = _narrowed_bits(inst, by_name, consumers)
            if bits is None and narrow and shapes and all(a.dtype == "f32" for a in shapes):
                bits = narrow
            if op == "all-reduce" and len(shapes) > 1:
                twins = set(_summed_twins(inst, consumers, module))
                shapes = [a for i, a in enumerate(shapes) if i not in twins]
            result_bytes = sum(a.elements * (bits or a.bits) // 8 for a in shapes)
            if op == "all-reduce" and _scatters(inst, consumers, size):
                op, result_bytes = "reduce-scatter", result_bytes // size
            axes = axes_of(groups[0], mesh) if groups and op != "collective-permute" else []
            found.append(Collective(kind=op, result_bytes=result_bytes, group_size=size, groups=len(groups),
                                    axes=axes, name=inst.name, example_group=groups[0][:16] if groups else []))
    return found
