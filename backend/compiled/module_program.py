"""A module's forward as one XLA program and its backward as another, joined to autograd.

`torch.compile(model)` on the tpu device, and the model half of compiled steps
(auto_compile.py). The forward is captured once per call signature (see
capture.py) and run as a jitted `jax.vjp` of the captured graph: it returns the
outputs and the residuals the backward needs, so `loss.backward()` runs one
program that does not recompute the forward. A `torch.autograd.Function` joins
the two to PyTorch autograd, so any loss, gradient clipping or optimizer works
around it.

A forward may return views: a view of a tensor it computed is an output of the program (its value), and a view
of an argument, a parameter, a buffer or another returned tensor is made after the run by the same view ops, so it
aliases that tensor as on the CPU (`_returns`).

Like `torch.compile`, a program treats Python values read in the forward as
constants: a signature is replayed only after two captures agreed on the graph,
its Python numbers and its small CPU constants. A forward that never agrees, or
that cannot be one program (it reads a device value on the host), runs as
written, and `reason_not_compiled` says why.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import torch

from ..core import executables, lazy, modes, steps
from . import whole_step
from .capture import (Capture, RebasedViews, autocast_state, compiling, constant_input, get_path, pair_storages,
                      rebuild, replay_key, signature, tensor_paths)
from ..core.jax_setup import device_x64
from ..core.launch import launch
from ..core.lazy import RECORDER, Lazy
from ..core.state import RNG
from ..core.tensor import TpuTensor
from ..core.transfer import materialize
from .whole_step import WINDOW, recording

TENSOR_KINDS = ("state", "arg")
HOLDS_COLLECTIVES = "its forward holds collectives"


class CompiledModule(torch.nn.Module):
    """`torch.compile(model)` on the tpu device."""

    MAX_CAPTURES = 4

    def __init__(self, module: torch.nn.Module, call=None):
        super().__init__()
        self._orig_mod = module
        # What computes the forward: the module itself, or (when its own `forward` is being
        # replaced by this one) its original forward method.
        self._call = call if call is not None else module
        self._programs: dict[tuple, ModuleProgram] = {}  # signature -> replayable program
        self._candidates: dict[tuple, ModuleProgram] = {}
        self._captures: dict[tuple, int] = {}
        self.reason_not_compiled: str | None = None
        self.replays = 0
        self._state: tuple[int, dict] | None = None  # (registrations seen, the module's named state)
        self.whole_step = False  # compiled steps: a call with gradients opens a step window (whole_step.py)
        self._lazy = True  # it may hold lazy modules not yet materialized (checked until it holds none)

    def state(self) -> dict:
        cached = self._state
        if cached is None or cached[0] != _Registrations.count:
            cached = self._state = (_Registrations.count, _state(self._orig_mod))
        return cached[1]

    def forward(self, *args, **kwargs):
        module = self._orig_mod
        if self.reason_not_compiled is not None or steps.suspended():
            # Inside a compiled step (a torch.compile'd step under compiled steps), captured or traced: its ops are
            # that step's program's; programs of its own would be launches of their own beside it.
            return self._call(*args, **kwargs)
        if self._lazy:
            self._lazy = _uninitialized(module)
            if self._lazy:  # as torch.compile does: the lazy modules' first forward materializes them, as written
                self._state = None  # their buffers become new tensors
                return self._call(*args, **kwargs)
        if self.whole_step and torch.is_grad_enabled():
            WINDOW.begin()
        state = self.state()
        key = (signature((args, kwargs)), module.training, autocast_state(),
               tuple((k, tuple(v.shape), v.dtype) for k, v in state.items()))
        program = self._programs.get(key)
        if program is not None:
            self.replays += 1
            return program(state, args, kwargs)
        program, problem = ModuleProgram.capture(module, self._call, state, args, kwargs)
        if program is None:
            if problem.startswith(HOLDS_COLLECTIVES) and self.whole_step:
                # It runs as written inside the step's window, so the step is still one program (its collectives
                # inside): the window opens before the module's own hooks (FSDP2 all-gathers the root's in one).
                module.register_forward_pre_hook(_open_window, prepend=True)
                self._give_up(problem, "it runs as written, recorded into the step's one program")
            else:
                self._give_up(problem)
            return self._call(*args, **kwargs)
        previous = self._candidates.get(key)
        if previous is not None and previous.key() == program.key():
            self._programs[key] = previous  # the same program: keep the one already compiled
            return previous(state, args, kwargs)
        self._captures[key] = self._captures.get(key, 0) + 1
        if self._captures[key] >= self.MAX_CAPTURES:
            self._give_up("its graph or Python numbers change from call to call")
        self._candidates[key] = program
        return program(state, args, kwargs)

    def _give_up(self, reason: str, then: str = "it runs as written") -> None:
        """`then`: what runs instead, so a step that is still one program is not read as a slow one."""
        self.reason_not_compiled = reason
        warnings.warn(f"tpu compile: {type(self._orig_mod).__name__} cannot be one program, {reason}; {then}",
                      stacklevel=3)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def _uninitialized(module) -> bool:
    return any(isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params()
               for m in module.modules())


def _open_window(module, args) -> None:
    if torch.is_grad_enabled():
        WINDOW.begin()


def _state(module) -> dict:
    return dict(module.named_parameters()) | dict(module.named_buffers())


class _Registrations:
    """Counts parameter, buffer and submodule assignments anywhere (PyTorch's global registration
    hooks): a model's state dict is walked again only after one, not on every call (a walk over
    a small transformer's modules cost more than its forward program's launch)."""

    count = 0

    @classmethod
    def bump(cls, *args):
        cls.count += 1

    @classmethod
    def install(cls) -> None:
        from torch.nn.modules import module as module_module

        module_module.register_module_parameter_registration_hook(cls.bump)
        module_module.register_module_buffer_registration_hook(cls.bump)
        module_module.register_module_module_registration_hook(cls.bump)


_Registrations.install()


class ModuleProgram:
    """One captured forward: its graph, where its inputs come from, and its jitted halves."""

    def __init__(self, exe, provenance, result_tree, return_map, view_map, buffer_updates, out_avals):
        self.exe = exe  # the recorder's graph (its `raw` is the pure function traced here)
        self.provenance = provenance  # per graph input: (kind, where)
        self.result_tree = result_tree
        self.return_map = return_map  # path in the result -> output index (a computed tensor, or a view's value)
        self.view_map = view_map  # path -> ((kind, where), view chain): a view made on the host after the run
        self.buffer_updates = buffer_updates  # [(buffer name, output index)]
        self.out_avals = out_avals
        self.floating = [jnp.issubdtype(a.dtype, jnp.floating) for a in out_avals]
        self._forward: dict[tuple, executables.Executable] = {}  # which tensor inputs need gradients -> program
        self._inference: executables.Executable | None = None
        self._backward: executables.Executable | None = None
        # Compiled steps' window: the same halves as nodes of the pending graph (record_forward, record_backward).
        self._forward_nodes: dict[tuple, lazy.Program] = {}
        self._backward_nodes: dict[tuple, lazy.Program] = {}
        self._residual_trees: dict[tuple, object] = {}  # needs_grad -> the VJP's tree (its leaves: residuals)

    def key(self) -> tuple:
        # The views made on the host hold Python numbers of their own (`x[:, :n]` of an argument): part of the key.
        return replay_key(self.exe, self.provenance), tuple(self.view_map.items())

    @classmethod
    def capture(cls, module, call, state, args, kwargs):
        """(program, None), or (None, why the forward cannot be one program)."""
        whole_step.WINDOW.captures += 1
        RECORDER.flush("before capture")
        # The forward's writes into its state (BatchNorm's running statistics) are undone once captured: the
        # program's run (or, if it cannot be one, the forward as written) makes them, once.
        before = [(t._storage_box, t._storage_box.array) for t in state.values() if isinstance(t, TpuTensor)]
        try:
            return cls._capture(call, state, args, kwargs)
        finally:
            for box, array in before:
                if box.array is not array:
                    box.write(array)

    @classmethod
    def _capture(cls, call, state, args, kwargs):
        rng = RNG.get_state()  # the program's own run draws these again: the same masks as eager mode
        owned = {id(t._storage_box): ("state", name) for name, t in state.items() if isinstance(t, TpuTensor)}
        rebased = RebasedViews((args, kwargs)).__enter__()
        capture = Capture.for_arguments((args, kwargs), owned)
        RECORDER.capture = capture
        RECORDER.last_flush = None
        try:
            with torch.no_grad(), modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE), steps.suspend(), \
                    compiling():
                result = call(*args, **kwargs)
                returned = tensor_paths(result)
                own_views = _views_to_compute(returned, capture.owned)
                RECORDER.flush("capture end", also=list(own_views.values()))
        finally:
            RECORDER.capture = None
            rebased.__exit__(None, None, None)
            RNG.set_state(*rng)
        if rebased.written:
            return None, "it writes into a tensor argument that is a view"
        if RECORDER.last_flush is None:
            return None, "it computes nothing on the device"
        exe, inputs, outputs, storages = RECORDER.last_flush
        if getattr(exe.fn, "ranks", None) is not None:  # its forward and backward programs are jitted alone
            return None, f"{HOLDS_COLLECTIVES} ({exe.fn.held}), which a module's programs cannot hold yet"
        provenance = capture.provenance(inputs)
        if capture.problems:
            return None, capture.problems[0]
        if any(kind in ("storage", "constant") for kind, _ in provenance):
            return None, "it reads device tensors that are neither its parameters, buffers nor arguments"
        index_of = {id(lz): i for i, lz in enumerate(outputs)}
        return_map, view_map, problem = _returns(returned, own_views, index_of, outputs, capture.owned, state)
        if problem:
            return None, problem
        arguments = {id(t._storage_box) for _, t in tensor_paths((args, kwargs))}
        if any(id(s) in arguments for s in storages):
            return None, "it writes into its tensor arguments"
        names = {id(t._storage_box): name for name, t in state.items()}
        buffer_updates = [(names[id(s)], index_of[id(lz)]) for s, lz in pair_storages(storages, outputs)
                          if id(s) in names]
        out_avals = [executables.abstract(lz) for lz in outputs]
        return cls(exe, provenance, result, return_map, view_map, buffer_updates, out_avals), None

    # --- running ---------------------------------------------------------------------
    def inputs(self, state, args, kwargs):
        """The tensor inputs (graph order) and the other inputs: numbers, RNG, CPU constants."""
        tensors, others = [], []
        drawn = [None]  # the base key of this call's draws
        for kind, value in self.provenance:
            if kind == "state":
                tensors.append(state[value])
            elif kind == "arg":
                tensors.append(get_path((args, kwargs), value))
            else:
                others.append(constant_input(kind, value, drawn))
        return tensors, others

    def __call__(self, state, args, kwargs):
        tensors, others = self.inputs(state, args, kwargs)
        needs_grad = tuple(bool(t.requires_grad) and t.is_floating_point() for t in tensors)
        if torch.is_grad_enabled() and any(needs_grad):
            outputs = GraphFunction.apply(self, needs_grad, tuple(others), *tensors)
        else:
            values = self.run_inference(tuple(others), [materialize(t) for t in tensors])
            outputs = tuple(TpuTensor(v) for v in values)
        with torch.no_grad():
            for name, index in self.buffer_updates:
                state[name]._storage_box.write(outputs[index].jax())
        if not self.view_map:
            return rebuild(self.result_tree, self.return_map, outputs)
        values, where = list(outputs), dict(self.return_map)
        for path, ((kind, at), chain) in self.view_map.items():
            base = outputs[at] if kind == "out" else state[at] if kind == "state" else get_path((args, kwargs), at)
            where[path] = len(values)
            values.append(replay_view(base, chain))
        return rebuild(self.result_tree, where, values)

    def assemble(self, tensors, others):
        t, o = iter(tensors), iter(others)
        return [next(t) if kind in TENSOR_KINDS else next(o) for kind, _ in self.provenance]

    def run_inference(self, others, arrays):
        if self._inference is None:
            graph = self.exe.raw

            def inference(others, arrays):
                return tuple(graph(*self.assemble(arrays, others)))

            self._inference = _executable("compiled_module_forward", inference, (others, arrays))
        return launch(self._inference, (others, arrays))

    def _forward_fn(self, needs_grad):
        """forward(others, diff, rest) -> (differentiable outputs, other outputs, VJP over `diff`)."""
        graph, floating = self.exe.raw, self.floating

        def forward(others, diff, rest):
            def f(*diff):
                d, r = iter(diff), iter(rest)
                tensors = [next(d) if g else next(r) for g in needs_grad]
                outs = graph(*self.assemble(tensors, others))
                return ([o for o, fl in zip(outs, floating) if fl], [o for o, fl in zip(outs, floating) if not fl])

            differentiable, vjp, other = jax.vjp(f, *diff, has_aux=True)
            return differentiable, other, vjp

        return forward

    def _merge(self, differentiable, other):
        d, r = iter(differentiable), iter(other)
        return [next(d) if fl else next(r) for fl in self.floating]

    def run_forward(self, needs_grad, others, arrays):
        """Outputs, and the residuals of their VJP with respect to the inputs that need gradients."""
        diff = [a for a, g in zip(arrays, needs_grad) if g]
        rest = [a for a, g in zip(arrays, needs_grad) if not g]
        exe = self._forward.get(needs_grad)
        if exe is None:
            exe = self._forward[needs_grad] = _executable("compiled_module_forward", self._forward_fn(needs_grad),
                                                          (others, diff, rest))
        differentiable, other, vjp = launch(exe, (others, diff, rest))
        return self._merge(differentiable, other), vjp

    def record_forward(self, needs_grad, others, arrays):
        """As run_forward, recorded as one node of the pending graph: outputs and the VJP's residuals, Lazy."""
        program = self._forward_nodes.get(needs_grad)
        if program is None:
            forward, n_others, n_diff = self._forward_fn(needs_grad), len(others), sum(needs_grad)

            def node(*flat):
                others, diff, rest = flat[:n_others], flat[n_others:n_others + n_diff], flat[n_others + n_diff:]
                differentiable, other, vjp = forward(others, diff, rest)
                residuals, self._residual_trees[needs_grad] = jax.tree_util.tree_flatten(vjp)
                return list(differentiable), list(other), residuals

            program = self._forward_nodes[needs_grad] = _node("compiled_module_forward", node)
        diff = [a for a, g in zip(arrays, needs_grad) if g]
        rest = [a for a, g in zip(arrays, needs_grad) if not g]
        differentiable, other, residuals = RECORDER.record(program, [*others, *diff, *rest])
        return self._merge(differentiable, other), residuals

    def record_backward(self, needs_grad, residuals, cotangents):
        """As run_backward, recorded: `cotangents` has None where an output got no gradient (zeros, made inside)."""
        present = tuple(c is not None for c in cotangents)
        program = self._backward_nodes.get((needs_grad, present))
        if program is None:
            avals = [a for a, fl in zip(self.out_avals, self.floating) if fl]
            n_residuals = len(residuals)

            def node(*flat):
                vjp = jax.tree_util.tree_unflatten(self._residual_trees[needs_grad], flat[:n_residuals])
                given = iter(flat[n_residuals:])
                cts = [next(given).astype(a.dtype) if p else jnp.zeros(a.shape, a.dtype) for a, p in zip(avals, present)]
                return list(vjp(cts))

            program = self._backward_nodes[(needs_grad, present)] = _node("compiled_module_backward", node)
        return RECORDER.record(program, [*residuals, *(c for c in cotangents if c is not None)])

    def run_backward(self, vjp, cotangents):
        if self._backward is None:
            self._backward = _executable("compiled_module_backward", lambda vjp, cts: vjp(list(cts)), (vjp, cotangents))
        return launch(self._backward, (vjp, cotangents))


def _views_to_compute(returned, owned) -> dict:
    """The returned views whose value the program computes as an output of its own: path -> the value (pending).

    A view of a tensor the forward computed (an unbatched input's `squeeze(0)`, attention's transposed output)
    whose base nothing else returned shares: the caller can reach that base through no other tensor, so the view's
    value, made contiguous, is all it can observe (the sizes, dtype and values it has in eager mode on tpu; an
    in-place write on it reaches nothing else). Views that share a base with another returned tensor, and views of
    arguments, parameters and buffers, keep aliasing them: made on the host after the run (`_returns`)."""
    sharing: dict[int, set] = {}  # storage -> the returned tensors on it (one tensor may be returned twice)
    for _, t in returned:
        sharing.setdefault(id(t._storage_box), set()).add(id(t))
    value_of: dict[int, Lazy] = {}  # id(tensor) -> its value, read once
    found = {}
    for path, t in returned:
        box = t._storage_box
        if t._view_chain and id(box) not in owned and len(sharing[id(box)]) == 1 and type(box.array) is Lazy:
            if id(t) not in value_of:
                value_of[id(t)] = t.jax()
            found[path] = value_of[id(t)]
    return found


def _returns(returned, own_views, index_of, outputs, owned, state):
    """How a replay rebuilds each returned tensor: (return_map, view_map, None), or (.., .., why it cannot).

    return_map: path -> output index (a computed tensor, or a view's value computed as an output of its own).
    view_map: path -> (source, chain), a view made on the host by replaying its chain of view ops on `source`:
    ("out", i) a computed output other returned tensors share (they alias each other, as in eager mode), ("arg",
    path) an argument, ("state", name) a parameter or buffer (an in-place write on the view shows in it, and
    gradients flow to it through the view ops' own backward)."""
    by_value = {id(lz.value): i for i, lz in enumerate(outputs)}
    return_map, view_map = {}, {}
    for path, t in returned:
        box, chain = t._storage_box, t._view_chain
        if path in own_views:
            return_map[path] = index_of[id(own_views[path])]
        elif id(box) in owned:
            kind, at = owned[id(box)]
            prefix = state[at]._view_chain if kind == "state" else ()  # a parameter that is a view itself
            if chain[:len(prefix)] != prefix:
                return {}, {}, "it returns a view of a parameter's storage that is not a view of the parameter"
            view_map[path] = ((kind, at), chain[len(prefix):])
        elif id(box.array) in by_value:
            if chain:
                view_map[path] = (("out", by_value[id(box.array)]), chain)
            else:
                return_map[path] = by_value[id(box.array)]
        else:
            return {}, {}, "it returns a tensor it neither computes on the device nor takes (a global tensor)"
    return return_map, view_map, None


def replay_view(base: torch.Tensor, chain: tuple) -> torch.Tensor:
    """`base` through a view chain's ops (views.chain_entry's links), as PyTorch ops: a view of `base` sharing its
    storage, with the ops' own autograd."""
    for func, args, kwargs, index in chain:
        out = func(base, *args, **dict(kwargs))
        base = out[index] if index is not None else out
    return base


def _node(name: str, fn) -> lazy.Program:
    """A module program's half as a node the recorder traces into its graph (compiled steps' window)."""
    return lazy.Program(executables.next_id(), name, fn, {}, scope=name)  # an id no executable has


def _executable(name: str, fn, args) -> executables.Executable:
    exe = executables.Executable(name=name, kind="compiled", fn=jax.jit(fn),
                                 args=jax.tree_util.tree_map(executables.abstract, args))
    return executables.register(exe)


class GraphFunction(torch.autograd.Function):
    """The forward program as an autograd node whose backward is the backward program."""

    @staticmethod
    def forward(ctx, program: ModuleProgram, needs_grad, others, *tensors):
        if recording():  # compiled steps' window: a node of the step's graph
            values, residuals = program.record_forward(needs_grad, others, [t.jax() for t in tensors])
            # Held by storages the recorder tracks: a flush before the backward computes them, not drops them.
            ctx.residuals, ctx.vjp = RECORDER.hold(residuals), None
        else:
            arrays = [materialize(t) for t in tensors]  # inside fused mode, pending inputs run first
            values, ctx.vjp = program.run_forward(needs_grad, others, arrays)
            ctx.residuals = None
        ctx.program, ctx.needs_grad = program, needs_grad
        ctx.set_materialize_grads(False)
        outputs = tuple(TpuTensor(v) for v in values)
        fixed = {i for _, i in program.buffer_updates} | {i for i, fl in enumerate(program.floating) if not fl}
        if fixed:
            ctx.mark_non_differentiable(*[outputs[i] for i in sorted(fixed)])
        return outputs

    @staticmethod
    @device_x64()  # autograd calls it directly, not through an op: the device's 64-bit scope
    def backward(ctx, *grads):
        program = ctx.program
        if ctx.vjp is None and ctx.residuals is None:
            raise RuntimeError("Trying to backward through a compiled tpu module's graph a second time; its "
                               "saved values were freed by the first backward (retain_graph is not supported)")
        floating = [g for g, fl in zip(grads, program.floating) if fl]
        if ctx.residuals is not None:
            residuals = ctx.residuals.values
            ctx.residuals = None
            input_grads = program.record_backward(ctx.needs_grad, residuals,
                                                  [None if g is None else g.jax() for g in floating])
            if not recording():  # the window closed before the backward: run it now
                RECORDER.flush("sync", also=input_grads)
                input_grads = [g.value for g in input_grads]
        else:
            cotangents = []
            for g, aval in zip(floating, [a for a, fl in zip(program.out_avals, program.floating) if fl]):
                if g is None:
                    cotangents.append(jnp.zeros(aval.shape, aval.dtype))
                else:
                    array = materialize(g)
                    cotangents.append(array if array.dtype == aval.dtype else array.astype(aval.dtype))
            input_grads = program.run_backward(ctx.vjp, tuple(cotangents))
            ctx.vjp = None  # free the residuals now, as autograd frees saved tensors
        input_grads = iter(input_grads)
        out = [None, None, None]
        for g in ctx.needs_grad:
            out.append(TpuTensor(next(input_grads)) if g else None)
        return tuple(out)
