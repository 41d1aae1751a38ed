"""`_foreach_*` ops (the optimizers' multi-tensor path) as one program per call.

Each is the per-tensor lowering mapped over the lists, so an optimizer step
over N parameters costs one dispatch and one XLA executable, not N.
"""

from __future__ import annotations

import inspect

import torch

from ..core.registry import LOWERINGS, lower

aten = torch.ops.aten

# `_foreach_X` maps to the per-tensor op X, except where the names differ.
_ELEMENT_OP = {"norm": "linalg_vector_norm", "max": "amax"}
# Per-element arguments: lists, plus the 1-d `scalars` tensor of `_foreach_addcmul.Tensor`.
_INDEXED_NAMES = {"scalars"}


def _element_lowering(base: str):
    packet = getattr(aten, _ELEMENT_OP.get(base, base), None)
    if packet is None:
        return None
    for overload in ("Tensor", "default", "Scalar", "List"):
        if overload in packet.overloads():
            entry = LOWERINGS.get(getattr(packet, overload))
            if entry is not None:
                return entry
    return None


def _make(schema, element_fn):
    indexed = [
        str(arg.type).startswith("List[") or (arg.name in _INDEXED_NAMES and str(arg.type) == "Tensor")
        for arg in schema.arguments
    ]
    names = [arg.name for arg in schema.arguments]
    params = inspect.signature(element_fn).parameters.values()
    n_positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY]

    def lowering(*args, **kwargs):
        values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
        out = []
        count = next(len(v) for j, v in enumerate(values) if indexed[j] and isinstance(v, (list, tuple)))
        for i in range(count):
            element = [v[i] if indexed[j] and v is not None else v for j, v in enumerate(values)]
            # Trailing scalars that are positional here can be keyword-only per tensor (addcmul's value).
            extra = dict(zip(keyword_only, element[n_positional:]))
            out.append(element_fn(*element[:n_positional], **extra))
        return out

    return lowering


def register_all() -> None:
    packets = {q.split("::", 1)[1].split(".", 1)[0] for q in torch._C._dispatch_get_all_op_names()}
    for name in sorted(packets):
        if not name.startswith("_foreach_") or name.endswith("_"):
            continue
        element = _element_lowering(name[len("_foreach_"):])
        if element is None or element.random or not element.jit:
            continue
        packet = getattr(aten, name)
        for overload_name in packet.overloads():
            overload = getattr(packet, overload_name)
            if overload._schema.is_mutable or overload in LOWERINGS:
                continue
            lower(overload, static_floats=element.static_floats)(_make(overload._schema, element.fn))


register_all()
