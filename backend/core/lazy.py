"""Deferred execution: ops recorded as a graph, run as one XLA program at a sync point.

In `DEFER_AND_FUSE` mode a program call (an op's lowering, a view read or
write, a cast) does not run: it returns `Lazy` placeholders and appends a
node to the pending graph. At a sync point (a value read, `.cpu()`, the
optimizer's step, `mark_step()`, `synchronize()`) the graph that produces
every still-alive pending value is built into one function, jit-compiled once
per graph structure and run. Values nobody holds any more are not outputs, so
XLA fuses them away; a training loop runs one program per step.

The same recorder captures a whole step for `torch.compile` (see compile.py).
"""

from __future__ import annotations

import operator
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from jax._src.array import ArrayImpl

from tpu_agent import envvars

from . import executables, mesh
from .jax_setup import device_x64
from .launch import launch
from .source import user_frame
from .state import STATE, STATS


_X64 = jax.enable_x64  # JAX's 64-bit switch: the device's scope (jax_setup.device_x64) holds it on


class Lazy:
    """A value to be computed by a pending node; shaped like the array it stands for."""

    __slots__ = ("node", "index", "aval_spec", "value", "__weakref__")

    def __init__(self, node, index, aval):
        self.node = node
        self.index = index
        self.aval_spec = aval  # jax.ShapeDtypeStruct
        self.value = None  # the concrete array once computed

    shape = property(lambda self: self.aval_spec.shape)
    dtype = property(lambda self: self.aval_spec.dtype)
    ndim = property(lambda self: len(self.aval_spec.shape))
    size = property(lambda self: int(np.prod(self.aval_spec.shape, dtype=np.int64)))


class Node:
    __slots__ = ("program", "inputs", "outputs", "treedef", "order", "keys")

    def __init__(self, program, inputs, order, keys):
        self.program = program
        self.inputs = inputs
        self.outputs: list[Lazy] = []
        self.treedef = None
        self.order = order
        self.keys = keys  # its inputs' aval keys, made once at record time: the flush's graph key reuses them


class Held:
    """Pending values a later node reads and no tensor holds (a compiled forward's residuals, which its backward
    reads): one object the recorder tracks for the group, where a Storage each cost a tracked wrapper per value
    (hundreds a step). While it is alive a flush computes them; `values` then holds the arrays."""

    __slots__ = ("values", "__weakref__")

    def __init__(self, values):
        self.values = values


@dataclass(eq=False)
class Program:
    """A function of arrays the recorder can replay: an op's lowering, a view, a cast."""

    id: int
    name: str  # the aten op, or view_read / cast for helpers
    raw: Callable  # unjitted: traced inside the graph
    out_avals: dict  # input avals -> (treedef, [ShapeDtypeStruct])
    scope: str = ""  # HLO metadata scope: the op and the user's source line, "aten.mm.default[train.py:42]"
    # A collective's global ranks (distributed/in_program.py): a graph holding one runs as the program its
    # `over_ranks(graph, programs, args)` returns, one SPMD program over those ranks, instead of jax.jit(graph).
    ranks: tuple | None = None

    def abstract_eval(self, args):
        key = tuple(map(_aval_key, args))
        cached = self.out_avals.get(key)
        if cached is None:
            shaped = jax.eval_shape(self.raw, *[executables.abstract(a) for a in args])
            leaves, treedef = jax.tree_util.tree_flatten(shaped)
            cached = self.out_avals[key] = (treedef, leaves)
        return cached


def _aval_key(a):
    t = type(a)  # `type is` first: isinstance against jax.Array costs more than the rest, hundreds of times a step
    if t is ArrayImpl or t is Lazy or isinstance(a, jax.Array):
        return (a.shape, a.dtype)  # np.dtype hashes by value; str() of it costs more than the op
    return t


# Flush reasons that cut a step's graph in two (the rest are step boundaries and syncs).
DATA_DEPENDENT = "data-dependent shape"
HOST_READ = "value read on the host"
SIZE_LIMIT = "graph size limit"
BREAK_REASONS = (DATA_DEPENDENT, HOST_READ, SIZE_LIMIT)

# Donate a compiled step's parameters too (inputs the forward and backward read before the update replaces them),
# not only the optimizer's state. On XLA:CPU that aliasing made odd_shapes' one-program step 12-24% slower (the same
# executable with and without it, 2026-12-05, load 4-6); the state alone cost nothing (0.97x). On an accelerator the
# memory counts more: there the parameters are donated as well. None: by the platform, asked at the first donation
# (not at import: the backend must not start before jax_setup has set the device count).
DONATE_READ_INPUTS: bool | None = None

# A loop with no sync point (forward and backward with no optimizer step or read) would
# grow one pending graph without bound, and compile a bigger one at every flush.
MAX_GRAPH_OPS = envvars.MAX_GRAPH_OPS.value


@dataclass
class GraphBreak:
    """A graph ended mid-step: the op that needed a concrete value, and where the user's code ran it."""

    reason: str  # DATA_DEPENDENT or HOST_READ
    op: str | None
    source: str | None  # file:line
    at_flush: int

    def describe(self) -> str:
        what = f"{self.op} ({self.reason})" if self.op else self.reason
        return f"{what} at {self.source}" if self.source else what


@dataclass
class Recompile:
    """A graph compiled after the first: when, and the input shapes that differ from the last one."""

    graph: str
    at_flush: int
    changed_shapes: list[str]
    compile_time_s: float


class Recorder:
    def __init__(self) -> None:
        # Storages whose array is Lazy, by id, held weakly. Plain weak references, not a WeakSet:
        # its add (a callback per reference) cost more than recording the op.
        self.pending: dict[int, weakref.ref] = {}
        self.order = 0
        self.graphs: dict[tuple, executables.Executable] = {}
        self.graph_programs: dict[int, tuple] = {}
        self.flushes = 0
        self.last_inputs: list | None = None
        self.last_avals: list = []  # the latest flush's inputs' aval keys (a recompile names the shapes that changed)
        self.recompiles: list[Recompile] = []
        self.breaks: list[GraphBreak] = []
        self.listeners: list[Callable] = []
        self.capture = None  # a compile.Capture while a step is being captured
        self.last_flush = None  # (executable, inputs, outputs, storages) of the latest flush
        self.max_ops = MAX_GRAPH_OPS
        self.since_flush = 0  # ops recorded since the last flush
        self.first_program = None  # the program of the first op recorded since then
        # Compiled steps (whole_step.py): ids of input arrays a node replaces (an optimizer's parameters and
        # state), each with the Lazy output replacing it, which the next flush may donate to XLA where nothing
        # else holds them; graphs compiled so.
        self.donate: dict[int, Lazy] = {}
        self.donating: dict[tuple, executables.Executable] = {}
        self.held: list[weakref.ref] = []  # Held groups, weakly

    # --- recording ------------------------------------------------------------------
    def record(self, program: Program, args):
        """Append a call of `program` to the graph; return its outputs as Lazy placeholders."""
        if not _X64.value:  # recorded from outside an op (a compiled module's or step's node): scope it here
            with device_x64():
                return self.record(program, args)
        if self.since_flush >= self.max_ops and self.capture is None and (
                program.id == self.first_program or self.since_flush >= self.max_ops + self.max_ops // 2):
            # Cut before the op the graph began with: a loop then cuts at the same place each time
            # and its graphs repeat (one compile), where a cut at a fixed count drifts through the loop.
            self.flush(SIZE_LIMIT, also=args, op=program.name)
        if self.since_flush == 0:
            self.first_program = program.id
        self.since_flush += 1
        args = [a.value if type(a) is Lazy and a.value is not None else a for a in args]
        keys = tuple(map(_aval_key, args))
        cached = program.out_avals.get(keys) if type(program) is Program else None
        treedef, avals = cached if cached is not None else program.abstract_eval(args)
        node = Node(program, args, self.order, keys)
        self.order += 1
        node.treedef = treedef
        node.outputs = [Lazy(node, i, aval) for i, aval in enumerate(avals)]
        return jax.tree_util.tree_unflatten(treedef, node.outputs)

    def track(self, storage) -> None:
        self.pending[id(storage)] = weakref.ref(storage)

    def hold(self, values: list) -> Held:
        """Keep pending `values` computable by the next flushes while the returned group is alive."""
        held = Held(values)
        self.held.append(weakref.ref(held))
        return held

    # --- running -------------------------------------------------------------------
    def flush(self, reason: str = "sync", also: list | tuple = (), op: str | None = None) -> None:
        """Compute every pending value that is still alive, and the placeholders in `also`
        (a view's pending value, which no storage holds). `op` names what needed the values. Inside the device's
        64-bit scope, wherever it is called from (a step boundary, a hook, `synchronize`)."""
        if not _X64.value:
            with device_x64():
                return self.flush(reason, also, op)
        storages = [s for s in (r() for r in self.pending.values()) if s is not None and type(s.array) is Lazy]
        self.pending = {}
        self.since_flush = 0
        held = [h for h in (r() for r in self.held) if h is not None]
        self.held = []  # each alive group is computed by this flush
        extra = [a for a in also if type(a) is Lazy and a.value is None and a.node is not None]
        for h in held:
            extra.extend(a for a in h.values if type(a) is Lazy and a.value is None and a.node is not None)
        if not storages and not extra:
            return
        if reason in BREAK_REASONS:
            self.breaks.append(GraphBreak(reason, op, user_frame(), self.flushes))
        if self.capture is not None and reason != "capture end":
            self.capture.interrupted(self.breaks[-1].describe() if reason in BREAK_REASONS else reason)
        # The previous flush's inputs and outputs are not needed now: dropping them here frees the arrays this
        # step replaces before it runs, and a donation's reference count need not subtract them (_donated).
        prev_avals = self.last_avals
        self.last_flush = self.last_inputs = None
        # A set has no stable order; the graph's outputs must, or every flush is a new graph.
        storages.sort(key=_STORAGE_ORDER)
        outputs: list[Lazy] = []
        seen_out: dict[int, int] = {}
        for lz in [s.array for s in storages] + sorted(extra, key=_LAZY_ORDER):
            if id(lz) not in seen_out:
                seen_out[id(lz)] = len(outputs)
                outputs.append(lz)
        nodes = _collect(outputs)
        inputs: list = []
        avals: list = []
        input_ids: dict[int, int] = {}
        node_index = {id(n): i for i, n in enumerate(nodes)}
        plan = []
        # The recorder's own references to each input an optimizer replaces (self.donate), and those that a node
        # other than the one replacing it reads: what _donated needs, counted in this one pass over the inputs.
        marked, self.donate = self.donate, {}
        uses: dict[int, int] = {}
        read_elsewhere: set[int] = set()
        marked_at: list[int] = []  # indices of the inputs in `marked` read directly
        get_input, add_input, add_aval = input_ids.get, inputs.append, avals.append
        for n in nodes:
            refs = []
            add_ref = refs.append
            for a, aval in zip(n.inputs, n.keys):
                direct = type(a) is not Lazy  # a computed Lazy holds its array once, however many nodes read it
                if not direct:
                    if a.value is None:
                        add_ref((0, node_index[id(a.node)], a.index))
                        continue
                    a = a.value
                k = id(a)
                j = get_input(k)
                if j is None:
                    j = input_ids[k] = len(inputs)
                    add_input(a)
                    add_aval(aval)
                add_ref((1, j, 0))
                if direct and k in marked:
                    count = uses.get(k)
                    if count is None:
                        uses[k] = 1
                        marked_at.append(j)
                    else:
                        uses[k] = count + 1
                    if marked[k].node is not n:
                        read_elsewhere.add(k)
            plan.append((n.program.id, tuple(refs)))
        a = None  # the loop's last value: no reference of this frame may hide a donation
        donated, outputs = self._donated(nodes, inputs, outputs, marked, uses, read_elsewhere, marked_at, seen_out)
        out_refs = tuple((node_index[id(o.node)], o.index) for o in outputs)
        key = (tuple(plan), out_refs, tuple(avals))
        if STATE.mesh is not None:
            inputs = mesh.align(inputs)  # before compiling: placements are part of the program
        exe = self.graphs.get(key)
        if exe is None:
            exe = self._compile(key, nodes, plan, out_refs, inputs, avals, prev_avals)
        values = launch(self._donating(exe, donated), inputs)
        self.flushes += 1
        self.last_inputs = inputs
        self.last_avals = avals
        for lz, v in zip(outputs, values):
            lz.value = v
        for s in storages:
            s.array = s.array.value
        for h in held:
            h.values = [a.value if type(a) is Lazy and a.value is not None else a for a in h.values]
        # Nodes and placeholders form reference cycles that hold every array of the step until
        # Python's cycle collector runs: cut them now that the values are known.
        for n in nodes:
            for lz in n.outputs:
                lz.node = None
            n.inputs = n.outputs = None
        self.last_flush = (exe, inputs, outputs, storages)
        for fn in self.listeners:
            fn(exe, reason)

    def _donated(self, nodes, inputs, outputs, marked, uses, read_elsewhere, marked_at, out_index):
        """The inputs this flush donates, and the outputs reordered so that XLA updates each in place.

        Donated: the inputs marked in `donate` (an optimizer's parameters and state, each with the output that
        replaces it) that nothing outside the recorder holds (a snapshot made with `copy_` shares its array: then
        no donation), as step_program.Plan donates; `uses` counts the nodes' references. jax pairs a donated input
        with the first output of its shape and dtype: with the step's gradients first among the outputs a
        parameter was paired with its gradient and XLA copied the arrays back (86 copies in odd_shapes' step
        program, 52 paired right; 36 without donation). So each replacement output comes first, in its input's
        order. Where DONATE_READ_INPUTS is off (XLA:CPU), an input another node also reads (`read_elsewhere`: a
        parameter the forward reads) is not donated. `marked_at`: the indices of the marked inputs a node reads
        directly; `out_index`: the outputs by id. The previous flush's inputs and outputs were let
        go before this one (flush), so the recorder's only references are the nodes' (`uses`)."""
        if not marked or STATE.mesh is not None or any(getattr(n.program, "ranks", None) for n in nodes):
            return (), outputs
        donate_read = DONATE_READ_INPUTS if DONATE_READ_INPUTS is not None else jax.default_backend() != "cpu"
        donated = []
        getrefcount = sys.getrefcount
        for i in sorted(marked_at):
            k = id(inputs[i])  # besides the nodes', the inputs list and getrefcount's argument hold it
            if id(marked[k]) in out_index and getrefcount(inputs[i]) <= uses[k] + 2 and (
                    donate_read or k not in read_elsewhere):
                donated.append(i)
        first = [marked[id(inputs[i])] for i in donated]
        moved = {id(o) for o in first}
        return tuple(donated), first + [o for o in outputs if id(o) not in moved]

    def _donating(self, exe, donated: tuple):
        """`exe`, or the same graph with the `donated` inputs donated (compiled once per graph and donation)."""
        if not donated:
            return exe
        key = (exe.id, donated)
        donating = self.donating.get(key)
        if donating is None:
            donating = self.donating[key] = executables.register(executables.Executable(
                name=exe.name, kind=exe.kind, fn=jax.jit(exe.raw, donate_argnums=donated), args=exe.args,
                ops=exe.ops, raw=exe.raw))
        return donating

    def _compile(self, key, nodes, plan, out_refs, inputs, avals, prev_avals):
        programs = [n.program for n in nodes]
        treedefs = [n.treedef for n in nodes]

        def graph(*args):
            env = []
            for (program_id, refs), program, treedef in zip(plan, programs, treedefs):
                call_args = [args[i] if kind else env[i][k] for kind, i, k in refs]
                with jax.named_scope(program.scope or program.name):
                    out = program.raw(*call_args)
                env.append(jax.tree_util.tree_leaves(out))
            return [env[i][k] for i, k in out_refs]

        name = f"fused_graph_{len(self.graphs)}"
        collective = next((p for p in programs if p.ranks is not None), None)
        exe = executables.Executable(
            name=name, kind="fused", raw=graph,
            fn=jax.jit(graph) if collective is None else collective.over_ranks(graph, programs, inputs),
            args=tuple(executables.abstract(a) for a in inputs),
            ops=tuple(p.name for p in programs),
        )
        t0 = time.perf_counter()
        _ = exe.compiled  # compile now, so its time is counted as compile time (jit reuses it)
        compile_time = time.perf_counter() - t0
        exe.compile_s = compile_time
        STATS.compiles += 1
        if self.graphs:
            self.recompiles.append(Recompile(name, self.flushes, _shape_diff(prev_avals, avals), compile_time))
        self.graphs[key] = executables.register(exe)
        return exe


_STORAGE_ORDER = operator.attrgetter("array.node.order", "array.index")  # a pending storage's place in the graph
_LAZY_ORDER = operator.attrgetter("node.order", "index")


def _collect(outputs: list[Lazy]) -> list[Node]:
    """Nodes the outputs depend on, in recording order."""
    found: dict[int, Node] = {}
    stack = [o.node for o in outputs]
    while stack:
        n = stack.pop()
        if id(n) in found:
            continue
        found[id(n)] = n
        for a in n.inputs:
            if type(a) is Lazy and a.value is None:  # `type is`: an optimizer's node reads ~1000 inputs a step
                stack.append(a.node)
    return sorted(found.values(), key=lambda n: n.order)


def _shape_diff(before: list, after: list) -> list[str]:
    """The input shapes of `after` that `before` did not have, from two flushes' aval keys ((shape, dtype) of an
    array, a type otherwise)."""
    def shapes(keys):
        return {f"{dtype}{list(shape)}" for key in keys if type(key) is tuple for shape, dtype in (key,)}

    return sorted(shapes(after) - shapes(before))


STATE.attach_recorder(Recorder())  # leaving fused mode flushes it
RECORDER = STATE.recorder
