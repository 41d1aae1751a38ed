"""The functional collectives (`_c10d_functional`: what DTensor, FSDP2 and `funcol` call) as op lowerings.

Each runs as an XLA collective over the group's ranks (distributed/collectives.py) on the tensor's array. In
fused mode all_reduce, all_gather_into_tensor, reduce_scatter_tensor (sum, avg), broadcast and
all_to_all_single (equal splits) are recorded into the pending graph, which runs as one program over the ranks
(distributed/in_program.py; their handlers are in distributed/functional.py); otherwise, and for the rest,
they run where they are met, the pending graph first. They complete when they return, so `wait_tensor` is
the identity.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (defines _c10d_functional._wrap_tensor_autograd)

from ..distributed import collectives
from ..distributed.process_group import group_ranks, reduce_op_name
from ..core.registry import lower

functional = torch.ops._c10d_functional


@lower(functional.all_reduce, jit=False, meta_check=False)
def all_reduce(x, reduce_op, group_name):
    return collectives.all_reduce(x, group_ranks(group_name), reduce_op_name(reduce_op))


@lower(functional.all_reduce_.default, jit=False, meta_check=False)
def all_reduce_(x, reduce_op, group_name):
    return all_reduce(x, reduce_op, group_name)


@lower(functional.all_reduce_coalesced, jit=False, meta_check=False)
def all_reduce_coalesced(xs, reduce_op, group_name):
    return [all_reduce(x, reduce_op, group_name) for x in xs]


@lower(functional.all_gather_into_tensor, jit=False, meta_check=False)
def all_gather_into_tensor(x, group_size, group_name):
    return collectives.all_gather(x, group_ranks(group_name, group_size))


@lower(functional.all_gather_into_tensor_coalesced, jit=False, meta_check=False)
def all_gather_into_tensor_coalesced(xs, group_size, group_name):
    return [all_gather_into_tensor(x, group_size, group_name) for x in xs]


@lower(functional.reduce_scatter_tensor, jit=False, meta_check=False)
def reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    return collectives.reduce_scatter(x, group_ranks(group_name, group_size), reduce_op_name(reduce_op))


@lower(functional.reduce_scatter_tensor_coalesced, jit=False, meta_check=False)
def reduce_scatter_tensor_coalesced(xs, reduce_op, group_size, group_name):
    return [reduce_scatter_tensor(x, reduce_op, group_size, group_name) for x in xs]


@lower(functional.broadcast, jit=False, meta_check=False)
def broadcast(x, src, group_name):
    ranks = group_ranks(group_name)
    return collectives.broadcast(x, ranks, ranks.index(src))  # src: a global rank


@lower(functional.all_to_all_single, jit=False, meta_check=False)
def all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
    ranks = group_ranks(group_name)
    out_splits, in_splits = [int(s) for s in output_split_sizes], [int(s) for s in input_split_sizes]
    if any(s != x.shape[0] // len(ranks) for s in out_splits + in_splits) or x.shape[0] % len(ranks):
        from ..distributed import exchange  # MoE's token dispatch: chunks padded to the largest any rank sends

        equal = [x.shape[0] // len(ranks)] * len(ranks)
        return exchange.all_to_all_uneven(x, ranks, out_splits or equal, in_splits or equal)
    return collectives.all_to_all(x, ranks)


@lower(functional.wait_tensor)
def wait_tensor(x):
    return x  # every collective has completed (its values may still be computing, as any op's)


@lower(functional._wrap_tensor_autograd.default)
def wrap_tensor_autograd(x):
    return x  # PyTorch wraps a collective's result for a later wait; ours has completed: nothing to wrap
