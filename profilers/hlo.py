"""Reads optimized HLO text: dots, convolutions and fusions with shapes, FLOPs and origin.

XLA's Python API gives each executable's cost as one total; the hot-ops table
and the padding report need it per instruction, with the aten op and user line
that the backend writes into `metadata={op_name=...}`. FLOPs here come from
shapes (2 per multiply-add; 1 per element for other arithmetic, transcendental
functions excluded as XLA does), so they approximate XLA's own count.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_NAME_EQ = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ATEN = re.compile(r"(aten\.[\w.]+)(?:\[([^\]]*)\])?")

BITS = {"pred": 8, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "s16": 16, "u16": 16, "f16": 16,
        "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
        "c64": 64, "c128": 128}

# Elementwise arithmetic XLA's cost analysis counts as one flop per output element.
ARITHMETIC = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "remainder", "abs", "negate",
    "compare", "select", "clamp", "sign", "floor", "ceil", "round-nearest-afz", "round-nearest-even",
    "and", "or", "xor", "not", "shift-left", "shift-right-logical", "shift-right-arithmetic",
}
TRANSCENDENTAL = {
    "exponential", "exponential-minus-one", "log", "log-plus-one", "sqrt", "rsqrt", "cbrt",
    "tanh", "logistic", "sine", "cosine", "tan", "atan2", "erf", "power",
}


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bits(self) -> int:
        return BITS.get(self.dtype, 32)

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_shape(text: str) -> list[Array]:
    """Every array in a (possibly tuple) HLO shape, layouts ignored."""
    return [Array(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) for m in _ARRAY.finditer(text)]


@dataclass
class Instruction:
    name: str
    opcode: str
    shape: list[Array]
    operands: list[str]
    attrs: str
    computation: str

    def attr(self, key: str) -> str | None:
        m = re.search(rf"(?:^|[,\s]){re.escape(key)}=(\{{[^}}]*\}}|\"[^\"]*\"|[^,\s]+)", self.attrs)
        return m.group(1) if m else None

    def int_list(self, key: str) -> tuple[int, ...]:
        value = self.attr(key)
        if not value:
            return ()
        return tuple(int(v) for v in re.findall(r"-?\d+", value))

    @property
    def op_name(self) -> str | None:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else None

    @property
    def called(self) -> list[str]:
        names = []
        for key in ("calls", "body", "condition", "to_apply", "true_computation", "false_computation",
                    "branch_computations"):
            value = self.attr(key)
            if value:
                names += re.findall(r"%?([\w.\-]+)", value.strip("{}"))
        return names


@dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str | None

    def instruction_map(self, computation: str) -> dict[str, Instruction]:
        return {i.name: i for i in self.computations.get(computation, [])}


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    in_string = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if c == '"' and text[i - 1] != "\\":
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def parse_instruction(line: str, computation: str) -> Instruction | None:
    m = _NAME_EQ.match(line)
    if not m:
        return None
    name = m.group(2)
    rest = line[m.end():]
    if rest.startswith("("):  # tuple shape
        end = _balanced(rest, 0)
        shape_text, rest = rest[:end], rest[end:]
    else:
        space = rest.find(" ")
        if space < 0:
            return None
        shape_text, rest = rest[:space], rest[space:]
    op = _OPCODE.match(rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = _balanced(rest, open_at)
    operand_text = rest[open_at + 1: close - 1]
    operands = []
    depth = 0
    piece = ""
    for c in operand_text + ",":
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            names = re.findall(r"%([\w.\-]+)", piece) or re.findall(r"([\w.\-]+)\s*$", piece.strip())
            if names:
                operands.append(names[-1])
            piece = ""
        else:
            piece += c
    return Instruction(name, op.group(1), parse_shape(shape_text), operands, rest[close:], computation)


def parse_module(text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h:
                current = h.group(2)
                computations[current] = []
                if h.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        inst = parse_instruction(line, current)
        if inst is not None:
            computations[current].append(inst)
    return Module(computations, entry)


# ----------------------------------------------------------------------------- FLOPs


@dataclass
class Contraction:
    """A dot or convolution, with what the padding model needs."""

    kind: str  # "dot" | "convolution"
    lhs: Array
    rhs: Array
    out: Array
    flops: float  # per execution, every kernel position counted (FlopCounterMode's convention)
    dot_dims: dict = field(default_factory=dict)  # lhs/rhs contracting and batch dims
    # Of `flops`, the multiply-adds that meet a convolution's implicit zero padding (or lhs dilation
    # holes): XLA's cost analysis leaves these out.
    padding_flops: float = 0.0
    conv: dict = field(default_factory=dict)  # out_batch, out_spatial, in_features, out_features, window, groups


def contraction(inst: Instruction, shapes: dict[str, Array]) -> Contraction | None:
    if inst.opcode not in ("dot", "convolution") or len(inst.operands) < 2 or not inst.shape:
        return None
    lhs, rhs = shapes.get(inst.operands[0]), shapes.get(inst.operands[1])
    out = inst.shape[0]
    if lhs is None or rhs is None:
        return None
    if inst.opcode == "dot":
        lc, rc = inst.int_list("lhs_contracting_dims"), inst.int_list("rhs_contracting_dims")
        lb, rb = inst.int_list("lhs_batch_dims"), inst.int_list("rhs_batch_dims")
        k = math.prod(lhs.dims[d] for d in lc if d < len(lhs.dims))
        return Contraction("dot", lhs, rhs, out, 2.0 * out.elements * k,
                           {"lhs_contracting": lc, "rhs_contracting": rc, "lhs_batch": lb, "rhs_batch": rb})
    labels = inst.attr("dim_labels") or ""
    m = re.match(r"(\w+)_(\w+)->(\w+)", labels)
    if not m:
        return None
    lhs_l, rhs_l, out_l = m.groups()
    groups = int(inst.attr("feature_group_count") or 1)
    batch_groups = int(inst.attr("batch_group_count") or 1)
    kernel_spatial = [rhs.dims[i] for i, c in enumerate(rhs_l) if c.isdigit()]
    i_features = rhs.dims[rhs_l.index("i")]
    o_features = rhs.dims[rhs_l.index("o")]
    out_spatial = tuple(out.dims[i] for i, c in enumerate(out_l) if c.isdigit())
    out_batch = out.dims[out_l.index("b")]
    window = tuple(kernel_spatial)
    flops = 2.0 * out.elements * math.prod(window) * i_features
    in_spatial = [lhs.dims[i] for i, c in enumerate(lhs_l) if c.isdigit()]
    inside = math.prod(in_bounds_taps(n, o, w) / (o * w.size) if o and w.size else 1.0
                       for n, o, w in zip(in_spatial, out_spatial, conv_window(inst, len(window))))
    return Contraction("convolution", lhs, rhs, out, flops, padding_flops=flops * (1.0 - inside), conv={
        "out_batch": out_batch, "out_spatial": out_spatial, "in_features": i_features,
        "out_features": o_features, "window": window, "groups": max(groups, batch_groups),
    })


@dataclass(frozen=True)
class WindowDim:
    size: int
    pad_lo: int = 0
    stride: int = 1
    lhs_dilate: int = 1
    rhs_dilate: int = 1


def conv_window(inst: Instruction, rank: int) -> list[WindowDim]:
    """The `window={size=3x3 pad=1_1x1_1 stride=...}` attribute, one entry per spatial dim."""
    text = inst.attr("window") or ""
    fields = dict(re.findall(r"(\w+)=([\d_x-]+)", text))

    def ints(key, default):
        values = fields.get(key)
        return [int(v.split("_")[0]) for v in values.split("x")] if values else [default] * rank

    size, pad, stride = ints("size", 1), ints("pad", 0), ints("stride", 1)
    lhs_d, rhs_d = ints("lhs_dilate", 1), ints("rhs_dilate", 1)
    return [WindowDim(*v) for v in zip(size, pad, stride, lhs_d, rhs_d)]


def in_bounds_taps(in_size: int, out_size: int, w: WindowDim) -> int:
    """Kernel positions, over all outputs along one dim, that land on a real input element."""
    span = (in_size - 1) * w.lhs_dilate
    count = 0
    for o in range(out_size):
        for k in range(w.size):
            pos = o * w.stride - w.pad_lo + k * w.rhs_dilate
            count += 0 <= pos <= span and pos % w.lhs_dilate == 0
    return count


def instruction_flops(inst: Instruction, shapes: dict[str, Array], module: Module, _seen=None) -> float:
    """FLOPs of one execution of an instruction (fusions and calls: their computations)."""
    c = contraction(inst, shapes)
    if c is not None:
        return c.flops
    if inst.opcode in ARITHMETIC:
        return float(sum(a.elements for a in inst.shape))
    if inst.opcode in ("reduce", "reduce-window"):
        first = shapes.get(inst.operands[0]) if inst.operands else None
        return float(first.elements) if first else 0.0
    if inst.opcode in ("fusion", "call"):
        return sum(computation_flops(module, name, _seen) for name in inst.called)
    return 0.0


def computation_flops(module: Module, name: str, _seen=None) -> float:
    seen = set() if _seen is None else _seen
    if name in seen:  # defensive: HLO call graphs are acyclic
        return 0.0
    seen = seen | {name}
    insts = module.computations.get(name, [])
    shapes = {i.name: i.shape[0] for i in insts if i.shape}
    return sum(instruction_flops(i, shapes, module, seen) for i in insts)


# ----------------------------------------------------------------------------- ops by origin


@dataclass
class HotOp:
    """A top-level instruction of an executable (a dot, a convolution or a fusion) and what it costs."""

    name: str
    opcode: str  # "dot", "convolution", "fusion"
    fusion_kind: str | None
    shape: str  # result
    flops: float  # per execution
    aten_op: str | None
    source: str | None
    contractions: list[Contraction]  # the dots and convolutions it runs


def origin(op_name: str | None) -> tuple[str | None, str | None]:
    """(aten op, user file:line) from metadata op_name like `jit(graph)/aten.mm.default[train.py:42]/dot_general`."""
    if not op_name:
        return None, None
    found = _ATEN.findall(op_name)
    if not found:
        return None, None
    op, src = found[-1]
    return op, src or None


def _contractions_in(module: Module, computation: str) -> list[Contraction]:
    insts = module.computations.get(computation, [])
    shapes = {i.name: i.shape[0] for i in insts if i.shape}
    out = []
    for inst in insts:
        c = contraction(inst, shapes)
        if c is not None:
            out.append((inst, c))
        elif inst.opcode in ("fusion", "call"):
            for name in inst.called:
                out += [(inst, cc) for cc in _contractions_in(module, name)]
    return [c for _, c in out]


def _first_origin(module: Module, computation: str) -> tuple[str | None, str | None]:
    """The origin of a fusion without metadata: its dot/convolution's, else its first known one."""
    insts = module.computations.get(computation, [])
    for inst in sorted(insts, key=lambda i: i.opcode not in ("dot", "convolution")):
        found = origin(inst.op_name)
        if found[0]:
            return found
    return None, None


def hot_ops(module: Module) -> list[HotOp]:
    """Dots, convolutions and fusions of the entry computation (and of called bodies), with FLOPs."""
    if module.entry is None:
        return []
    result: list[HotOp] = []
    visited: set[str] = set()

    def walk(computation: str) -> None:
        if computation in visited:
            return
        visited.add(computation)
        insts = module.computations.get(computation, [])
        shapes = {i.name: i.shape[0] for i in insts if i.shape}
        for inst in insts:
            if inst.opcode in ("while", "call", "conditional"):
                for name in inst.called:
                    walk(name)
                continue
            if inst.opcode not in ("dot", "convolution", "fusion"):
                continue
            c = contraction(inst, shapes)
            contractions = [c] if c else [cc for name in inst.called for cc in _contractions_in(module, name)]
            aten_op, source = origin(inst.op_name)
            if aten_op is None and inst.opcode == "fusion":
                for name in inst.called:
                    aten_op, source = _first_origin(module, name)
                    if aten_op:
                        break
            kind = inst.attr("kind")
            result.append(HotOp(
                name=inst.name, opcode=inst.opcode, fusion_kind=kind,
                shape=", ".join(map(str, inst.shape)),
                flops=instruction_flops(inst, shapes, module),
                aten_op=aten_op, source=source, contractions=contractions,
            ))

    walk(module.entry)
    return result
