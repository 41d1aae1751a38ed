"""The `tpu` process-group backend of torch.distributed.

Registered at `import torch` (device.register) with `Backend.register_backend("tpu", ..., devices=["tpu"])`,
so `init_process_group()` with no backend, `"tpu"`, or `"cpu:gloo,tpu:tpu"`, and `init_device_mesh("tpu", ...)`
all build a `TpuProcessGroup`. It is a Python `ProcessGroup` (PyTorch's C++ callers, DDP's reducer among them,
reach its methods through the pybind trampoline): collectives on tpu tensors run as XLA programs over the
ranks' devices (collectives.py), never through the host; collectives on CPU tensors go to a gloo backend it
registers for the CPU, so a CPU-only script keeps gloo. JAX is not imported here: a CPU-only script that
never touches tpu never starts it.

Every collective completes before it returns (its result arrays are still computed asynchronously by XLA);
its Work is a completed future holding the output tensors, which is what DDP's communication hooks read.
"""

from __future__ import annotations

from datetime import timedelta
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo, ReduceOp, _create_work_from_future
from torch.futures import Future

from ..core.state import STATE
from . import faults

NAME = "tpu"
DEVICE_TYPE = "tpu"

_REDUCE_OPS = MappingProxyType({ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                               ReduceOp.PRODUCT: "product", ReduceOp.BAND: "band", ReduceOp.BOR: "bor",
                               ReduceOp.BXOR: "bxor"})


def reduce_op_name(op) -> str:
    """A ReduceOp (or its RedOpType, or the functional collectives' string) as collectives.py names it."""
    if isinstance(op, str):
        return op.lower()
    for known, name in _REDUCE_OPS.items():
        if op == known:
            return name
    kind = getattr(op, "op", op)
    raise NotImplementedError(f"tpu: reduce op {getattr(kind, 'name', kind)} is not supported here")


def group_ranks(group, size: int | None = None) -> tuple[int, ...]:
    """The global ranks of a tpu process group, given as the functional collectives name it."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = group if isinstance(group, ProcessGroup) else _resolve_process_group(group)
    if not isinstance(pg, TpuProcessGroup):
        raise RuntimeError(f"tpu: a collective on tpu tensors over a process group whose backend is "
                           f"{pg.name()!r}; start it with the tpu backend (init_process_group() with no backend, "
                           f"or 'tpu', or 'cpu:gloo,tpu:tpu')")
    if size is not None and size != len(pg.ranks):
        raise RuntimeError(f"tpu: group size {size} given for a group of {len(pg.ranks)} ranks")
    return pg.ranks


def _completed(result) -> object:
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class _Posted(dist.Work):
    """A send or receive posted, not yet run: its wait (or the group's next tpu collective) runs every posted one.
    A rank may post its send before its receive while its partner does the same (batch_isend_irecv, a pipeline
    exchange); run as posted, each send would meet the partner's send."""

    def __init__(self, group: "TpuProcessGroup", tensors) -> None:
        super().__init__()
        self._group, self._tensors = group, tensors

    def wait(self, timeout=None) -> bool:
        self._group._settle()
        return True

    def is_completed(self) -> bool:
        return not self._group._posted

    def get_future(self):
        self._group._settle()
        future = Future()
        future.set_result(self._tensors)
        return future


def _premul_factor(opts):
    """PREMUL_SUM's factor (each rank's input times it, then summed), else None. FSDP2 reduce-scatters with
    PREMUL_SUM(1 / factor) when a gradient divide factor is set: TorchTitan sets 1.0."""
    op = opts.reduceOp if opts is not None else None
    return op.factor if getattr(op, "op", None) == ReduceOp.RedOpType.PREMUL_SUM else None


def _reduction(opts) -> tuple[str, object]:
    """(the reduce op as collectives.py names it, PREMUL_SUM's factor or None): PREMUL_SUM is a sum of the
    inputs times the factor, in every reducing collective."""
    factor = _premul_factor(opts)
    if factor is not None:
        return "sum", factor
    return reduce_op_name(opts.reduceOp if opts is not None else ReduceOp.SUM), None


def _scales(factor) -> bool:
    return factor is not None and (isinstance(factor, torch.Tensor) or factor != 1)


def _scaled(t, factor):
    """`t` times PREMUL_SUM's factor (a new tensor; `t` itself when there is none)."""
    return t * factor if _scales(factor) else t


def _equal_splits(splits, rows: int, n: int) -> bool:
    return not splits or (rows % n == 0 and all(s == rows // n for s in splits))


def _on_tpu(tensors) -> bool:
    return bool(tensors) and tensors[0].device.type == DEVICE_TYPE


class _TpuBackendInfo:
    """What PyTorch's Python asks of a group's backend for a tpu device (`init_process_group(device_id=...)` and
    `new_group` ask whether it can split a communicator): it cannot; the collectives are the group's own."""

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def name(self) -> str:
        return NAME


class TpuProcessGroup(ProcessGroup):
    """A process group whose tpu collectives are XLA collectives across the ranks' JAX processes."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta, ranks: list[int]):
        super().__init__(rank, size)
        self.ranks = tuple(ranks) if ranks else tuple(range(size))  # the group's global ranks, in group order
        state = STATE.distributed
        state.groups_made += 1  # every rank creates its groups in the same order: a fresh store prefix for each gloo
        self._gloo = ProcessGroupGloo(dist.PrefixStore(f"tpu-gloo/{state.groups_made}/", store), rank, size, timeout)
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        faults.attach(self.ranks, store, self.ranks[rank], timeout)  # collectives that never complete time out
        self._posted: list[tuple[str, object, int]] = []  # ("send" | "recv", tensor or its value, global peer)

    def _get_backend(self, device):
        if getattr(device, "type", device) == DEVICE_TYPE:
            return _TpuBackendInfo()
        return super()._get_backend(device)

    def getBackendName(self) -> str:  # noqa: N802 - PyTorch's name
        return NAME

    def name(self) -> str:
        return NAME

    @property
    def _ops(self):
        """Every tpu collective but send and recv goes through here: posted sends and receives run first."""
        from . import tensor_ops  # JAX comes in with the first tpu collective, not before

        self._settle()
        return tensor_ops

    def _settle(self) -> None:
        """Run the posted sends and receives in one order both ends of each pair compute alike: pairs by their
        ranks, then the lower rank's sends to the higher, then the other way, each direction as posted."""
        posted, self._posted = self._posted, []
        me = self.ranks[self.rank()]
        for peer in sorted({p for _, _, p in posted}):
            for sender in sorted((me, peer)):
                kind = "send" if sender == me else "recv"
                for what, value, _ in [op for op in posted if op[2] == peer and op[0] == kind]:
                    getattr(self._exchange, kind)(value, me, peer)

    @property
    def _exchange(self):
        from . import exchange

        return exchange

    # --- collectives: tpu tensors here, CPU tensors to gloo ---------------------------------------
    def _gloo_does(self, name: str, *args, opts=None):
        """The CPU tensors' collective, run by the group's gloo backend. (Not `super().name`: pybind tells a
        Python override calling its base apart only from the overriding frame itself.)"""
        method = getattr(self._gloo, name)
        return method(*args, opts) if opts is not None else method(*args)

    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):  # pg.allreduce(tensor) as PyTorch's binding allows
            tensors = [tensors]
        if not _on_tpu(tensors):
            return self._gloo_does("allreduce", tensors, opts=opts)
        op, factor = _reduction(opts)
        for t in tensors:
            if _scales(factor):
                t.mul_(factor)
            self._ops.all_reduce_(t, self.ranks, op)
        return _completed(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts) if _on_tpu(tensors) else self._gloo_does("allreduce_coalesced", tensors, opts=opts)

    def allgather(self, output_lists, inputs, opts=None):
        if not _on_tpu(inputs):
            return self._gloo_does("allgather", output_lists, inputs, opts=opts)
        for outputs, t in zip(output_lists, inputs):
            self._ops.all_gather_list(outputs, t, self.ranks)
        return _completed(output_lists)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002 - PyTorch's names
        if not _on_tpu([input]):
            return self._gloo_does("_allgather_base", output, input, opts=opts)
        self._ops.all_gather_into(output, input, self.ranks)
        return _completed([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, t in zip(outputs, inputs):
            self._allgather_base(output, t, opts).wait()
        return _completed(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    all_gather_single = _allgather_base  # PyTorch 2.13's name for all_gather_into_tensor

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        if not _on_tpu([input]):
            return self._gloo_does("_reduce_scatter_base", output, input, opts=opts)
        op, factor = _reduction(opts)
        self._ops.reduce_scatter_into(output, _scaled(input, factor), self.ranks, op)
        return _completed([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, t in zip(outputs, inputs):
            self._reduce_scatter_base(output, t, opts).wait()
        return _completed(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outputs, input_lists, opts=None):
        if not _on_tpu(outputs):
            return self._gloo_does("reduce_scatter", outputs, input_lists, opts=opts)
        op, factor = _reduction(opts)
        for output, inputs in zip(outputs, input_lists):
            self._ops.reduce_scatter_list(output, [_scaled(t, factor) for t in inputs], self.ranks, op)
        return _completed(outputs)

    def broadcast(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not _on_tpu(tensors):
            return self._gloo_does("broadcast", tensors, opts=opts)
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            self._ops.broadcast_(t, self.ranks, root)
        return _completed(tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        if not _on_tpu([input]):
            return self._gloo_does("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts=opts)
        out_splits, in_splits, n = list(output_split_sizes or []), list(input_split_sizes or []), len(self.ranks)
        if _equal_splits(out_splits, output.shape[0], n) and _equal_splits(in_splits, input.shape[0], n):
            self._ops.all_to_all_into(output, input, self.ranks, [], [])
        else:  # MoE's token dispatch: each rank sends each other rank its own number of rows
            self._exchange.all_to_all_single(output, input, self.ranks, out_splits or [output.shape[0] // n] * n,
                                       in_splits or [input.shape[0] // n] * n)
        return _completed([output])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        if not _on_tpu(inputs):
            return self._gloo_does("alltoall", outputs, inputs, opts=opts)
        if len({(t.shape, t.dtype) for t in [*inputs, *outputs]}) == 1:
            self._ops.all_to_all_list(outputs, inputs, self.ranks)
        else:
            self._exchange.all_to_all_list(outputs, inputs, self.ranks)
        return _completed(outputs)

    def send(self, tensors, dst, tag=0):
        if not _on_tpu(tensors):
            return self._gloo_does("send", tensors, dst, tag)
        self._posted.extend(("send", t.clone(), self.ranks[dst]) for t in tensors)  # the value now, as gloo sends
        return _Posted(self, tensors)

    def recv(self, tensors, src, tag=0):
        if not _on_tpu(tensors):
            return self._gloo_does("recv", tensors, src, tag)
        self._posted.extend(("recv", t, self.ranks[src]) for t in tensors)
        return _Posted(self, tensors)

    def recv_anysource(self, tensors, tag=0):
        if not _on_tpu(tensors):
            return self._gloo_does("recv_anysource", tensors, tag)
        raise NotImplementedError("tpu: recv without a source (recv_anysource) is not supported on tpu tensors: "
                                  "name the sending rank")

    def reduce(self, tensors, opts=None):
        if not _on_tpu(tensors):
            return self._gloo_does("reduce", tensors, opts=opts)
        op, factor = _reduction(opts)
        for t in tensors:  # every rank computes the reduction; only the root's tensor takes it (as gloo)
            scaled = _scaled(t, factor)
            self._ops.all_reduce_(scaled, self.ranks, op, only_rank=opts.rootRank)
            if scaled is not t and self.rank() == opts.rootRank:
                t.copy_(scaled)
        return _completed(tensors)

    def gather(self, output_lists, inputs, opts=None):
        if not _on_tpu(inputs):
            return self._gloo_does("gather", output_lists, inputs, opts=opts)
        outputs = output_lists[0] if output_lists else []
        self._ops.gather_list(outputs, inputs[0], self.ranks, write=self.rank() == opts.rootRank)
        return _completed(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        if not _on_tpu(outputs):
            return self._gloo_does("scatter", outputs, input_lists, opts=opts)
        self._ops.scatter_from(outputs[0], input_lists[0] if input_lists else [], self.ranks, opts.rootRank)
        return _completed(outputs)

    def barrier(self, opts=None):
        """On the ranks' devices once the job has joined them (`dist.barrier()` names the CPU): gloo finishes
        a barrier on its worker thread and drops the work there, and a work dropped while the interpreter
        finalizes aborts the process (PyTorch's own teardown race, 'terminate called without an active
        exception': 3 of 56 two-rank CPU DDP jobs that end with barrier() under a load of 3-4, the tool off).
        Through gloo before then: a CPU-only script never starts the device."""
        device = getattr(opts, "device", None) if opts is not None else None
        if (device is not None and device.type == DEVICE_TYPE) or STATE.distributed.joined is not None:
            self._ops.barrier(self.ranks)
            return _completed([])
        return self._gloo_does("barrier", opts=opts)


def create(common_opts, backend_options=None) -> TpuProcessGroup:
    """The creator `register_backend` calls (extended API: the store, group rank and size, global ranks). A rank
    whose partner ended during the rendezvous (its own bad input, say) ends with one line, not a traceback."""
    try:
        return TpuProcessGroup(common_opts.store, common_opts.group_rank, common_opts.group_size,
                               common_opts.timeout, list(common_opts.global_ranks_in_group or []))
    except RuntimeError as exc:
        if faults.another_rank_left(exc):
            faults.partner_gone(exc)
        raise


def register() -> None:
    """Make `tpu` a torch.distributed backend; no backend named means this one (it does CPU tensors with
    gloo). Called at `import torch` (device.register): cheap, no JAX."""
    if NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, create, extended_api=True, devices=[DEVICE_TYPE])
    _no_backend_named_means_tpu()


def name_set_timeout() -> None:
    """PyTorch after 2.13's public name for _set_pg_timeout: TorchTitan 0.3.0 calls it after its first step (on
    any device); 2.13 has only the private one. It sets the gloo half of a tpu group's timeout. Named in the
    tool's child only (run.child), so a script run without the tool sees torch.distributed as it is."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout


def _no_backend_named_means_tpu() -> None:
    """`init_process_group()` with no backend takes "the accelerator's" backend alone. A script may start its
    process group before its first tpu op, so whether it will use tpu is not known yet: it gets this backend,
    which runs CPU tensors' collectives with gloo (a CPU-only script computes exactly as before) and tpu
    tensors' on the device."""
    from torch.distributed import distributed_c10d

    config = distributed_c10d.BackendConfig
    original = config.__init__
    if getattr(original, "_tpu_agent", False):
        return

    def __init__(self, backend):  # noqa: N807
        original(self, backend)
        if str(backend) == dist.Backend.UNDEFINED and set(self.device_backend_map) <= {"cpu", DEVICE_TYPE}:
            self.device_backend_map = {DEVICE_TYPE: dist.Backend(NAME)}

    __init__._tpu_agent = True
    config.__init__ = __init__
