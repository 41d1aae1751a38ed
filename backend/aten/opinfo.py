"""What dispatch knows of one aten op, read from its schema and looked up once per op.

Its kind (functional, view, mutating), the functional op a mutating one computes and the arguments it writes,
its return types, and the handler or lowering that runs it: torch-level facts, no device value. The handler
table is filled by handlers.py as ops/ fills the lowering table (registry.py); dispatch.py imports both
before the first op, so the `OpInfo` built at an op's first call sees them.
"""

from __future__ import annotations

import functools

import torch

from ..core.registry import LOWERINGS

aten = torch.ops.aten

HANDLERS: dict = {}


def handler(*ops):
    """Register a device handler: it gets the torch-level arguments, not arrays."""

    def decorate(fn):
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return decorate


# --------------------------------------------------------------------------
# op classification
# --------------------------------------------------------------------------

FUNCTIONAL, VIEW, MUTATING = "functional", "view", "mutating"


# Ops whose kernels write arguments their schema does not mark as written (legacy annotations): the names
# of those arguments. Their lowering returns the schema's results, then the new value of each named argument
# (None where this call leaves it alone); dispatch writes them back (dispatch.run_undeclared). PyTorch's CPU
# and CUDA kernels of native_batch_norm update running_mean / running_var in training, and
# batch_norm_update_stats (CPU) and batch_norm_gather_stats(_with_counts) (CUDA, SyncBatchNorm) do as well.
UNDECLARED_WRITES: dict = {
    aten.native_batch_norm.default: ("running_mean", "running_var"),
    aten.batch_norm_update_stats.default: ("running_mean", "running_var"),
    aten.batch_norm_gather_stats.default: ("running_mean", "running_var"),
    aten.batch_norm_gather_stats_with_counts.default: ("running_mean", "running_var"),
}


@functools.lru_cache(maxsize=None)
def op_kind(func) -> str:
    schema = func._schema
    if schema.is_mutable or func in UNDECLARED_WRITES:
        return MUTATING
    for ret in schema.returns:
        if ret.alias_info is not None and not ret.alias_info.is_write:
            return VIEW
    return FUNCTIONAL


@functools.lru_cache(maxsize=None)
def functional_variant(func):
    """The functional op a mutating op computes, or None."""
    schema = func._schema
    packet = func.overloadpacket
    name = packet.__name__
    overload = func._overloadname
    candidates = []
    if name.endswith("_") and not name.endswith("__"):
        candidates.append((name[:-1], overload))
    candidates.append((name + "_functional", overload))
    if overload == "out" or overload.endswith("_out"):
        base = overload[: -len("out")].rstrip("_")
        for other in packet.overloads():
            if other == base or (base == "" and other == "default"):
                candidates.append((name, other))
        candidates.append((name, "default"))
    for cand_name, cand_overload in candidates:
        cand_packet = getattr(aten, cand_name, None)
        if cand_packet is None:
            continue
        if cand_overload not in cand_packet.overloads():
            continue
        cand = getattr(cand_packet, cand_overload)
        if cand._schema.is_mutable:
            continue
        if cand is func:
            continue
        if _args_match(schema, cand._schema):
            return cand
    return None


def _args_match(mutating, functional) -> bool:
    names = [a.name for a in mutating.arguments if not (a.alias_info and a.alias_info.is_write) or a.name == "self"]
    cand = [a.name for a in functional.arguments]
    return all(n in cand for n in names if n not in ("out",))


def written_args(func) -> list[str]:
    """The arguments an op writes: those its schema marks, then those it writes unannounced (UNDECLARED_WRITES)."""
    return ([a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            + list(UNDECLARED_WRITES.get(func, ())))


def is_out(func) -> bool:
    return any(a.is_out for a in func._schema.arguments)


def is_list_return(func) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and str(returns[0].type).startswith("List[")


def bind(func, args, kwargs) -> dict:
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def functional_call_args(func, functional, bound):
    args, kwargs = [], {}
    for arg in functional._schema.arguments:
        if arg.name not in bound:
            continue
        if arg.kwarg_only:
            kwargs[arg.name] = bound[arg.name]
        else:
            args.append(bound[arg.name])
    return tuple(args), kwargs


@functools.lru_cache(maxsize=None)
def _return_types(func) -> tuple[str, ...]:
    return tuple(str(r.type) for r in func._schema.returns)


# --------------------------------------------------------------------------
# one record per op
# --------------------------------------------------------------------------


class OpInfo:
    """What dispatch needs to know of one aten op, looked up once: its handler, kind, lowering and
    return types. Keyed by `id(op)` (ops live as long as the process): an OpOverload's own
    `__hash__` is Python code, and a dict lookup by it would run that on every op."""

    __slots__ = ("func", "handler", "kind", "lowering", "returns", "name", "scalar_results")

    def __init__(self, func):
        self.func = func
        self.handler = HANDLERS.get(func)
        self.kind = op_kind(func)
        self.lowering = LOWERINGS.get(func)
        self.returns = _return_types(func)
        self.name = str(func)
        # Python numbers among its results (attention's sequence lengths): recorded, those come from
        # the meta kernel (execute._static_scalars)
        self.scalar_results = (bool(self.returns) and not self.returns[0].startswith("List[")
                               and any(r in SCALAR_TYPES for r in self.returns))


SCALAR_TYPES = frozenset({"bool", "int", "float", "SymInt", "Scalar"})  # results returned as Python numbers
INFO: dict[int, OpInfo] = {}


def info_of(func) -> OpInfo:
    info = INFO.get(id(func))
    if info is None:
        info = INFO[id(func)] = OpInfo(func)
    return info
