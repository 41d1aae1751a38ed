"""The functional collectives' handlers (`_c10d_functional`: DTensor's and `funcol`'s): in fused mode
all_reduce, all_gather_into_tensor, reduce_scatter_tensor (sum, avg), broadcast and all_to_all_single (equal
splits) are recorded into the pending graph, which runs as one program over the ranks (in_program.py);
otherwise, and for what cannot be recorded, their lowerings in ops/collectives.py run as before. Imported by
handlers.py (after execute, whose `execute` the handlers call); it loads the lowerings it wraps first."""

from __future__ import annotations

import torch

from ..aten.execute import execute
from ..aten.opinfo import handler
from ..ops import collectives as _lowerings  # noqa: F401  (registers the lowerings the handlers here wrap)
from ..core.registry import LOWERINGS
from ..core.tensor import TpuTensor
from . import in_program
from .process_group import group_ranks, reduce_op_name

functional = torch.ops._c10d_functional


def _in_graph(op):
    """Make `record(*args)` `op`'s handler in fused mode (None from it: not recordable, run as lowered)."""

    def decorate(record):
        lowering = LOWERINGS[op]

        @handler(op)
        def run(*args, **kwargs):
            if in_program.recording() and isinstance(args[0], TpuTensor) and not kwargs:
                out = record(*args)
                if out is not None:
                    return out
            return execute(op, lowering, args, kwargs)

        return record

    return decorate


def _recorded(kind, x, ranks, **static):
    return TpuTensor(in_program.record(kind, ranks, x.jax(), **static))


@_in_graph(functional.all_reduce.default)
def _all_reduce(x, reduce_op, group_name):
    return _recorded("all_reduce", x, group_ranks(group_name), op=reduce_op_name(reduce_op))


@_in_graph(functional.all_reduce_.default)
def _all_reduce_(x, reduce_op, group_name):
    x.set_jax(in_program.record("all_reduce", group_ranks(group_name), x.jax(), op=reduce_op_name(reduce_op)))
    return x


@_in_graph(functional.all_gather_into_tensor.default)
def _all_gather_into_tensor(x, group_size, group_name):
    return _recorded("all_gather", x, group_ranks(group_name, group_size)) if x.dim() else None


@_in_graph(functional.reduce_scatter_tensor.default)
def _reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    op = reduce_op_name(reduce_op)
    ranks = group_ranks(group_name, group_size)
    recordable = op in ("sum", "avg") and x.dim() and x.shape[0] % len(ranks) == 0
    return _recorded("reduce_scatter", x, ranks, op=op) if recordable else None


@_in_graph(functional.broadcast.default)
def _broadcast(x, src, group_name):
    ranks = group_ranks(group_name)
    return _recorded("broadcast", x, ranks, root=ranks.index(src))


@_in_graph(functional.all_to_all_single.default)
def _all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
    ranks = group_ranks(group_name)
    rows = x.shape[0] if x.dim() else 0
    if not rows or rows % len(ranks) or any(int(s) != rows // len(ranks)
                                            for s in list(output_split_sizes) + list(input_split_sizes)):
        return None
    return _recorded("all_to_all", x, ranks)
