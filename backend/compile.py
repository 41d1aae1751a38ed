"""Compiled execution: a whole step, or a module's forward and backward, as XLA programs.

`torch.tpu.compile(step_fn)` (and `torch.compile(step_fn)` on tpu tensors) runs
the step under the fused recorder, which yields one graph for forward,
backward and optimizer update, and notes where each graph input came from: a
tensor argument, a tensor that existed before the call (parameters, optimizer
state), the RNG, or a Python number. Once two consecutive captures give the
same graph and the same Python numbers, later calls replay the compiled
program directly: inputs are read from those tensors, outputs written back,
and no Python of the step runs, so per-op overhead disappears.

Like `torch.compile`, replay treats Python values read in the step as
constants. A step is re-captured when its tensor arguments change shape or
dtype, or an optimizer's hyperparameters (lr, betas, ...) change; a step that
reads a device value on the host (`.item()`), moves data from the CPU, or
whose Python numbers change from call to call is re-traced on every call
(fused mode), and the reason is kept in `reason_not_replayed`.

`torch.compile(model)` compiles the module's forward as one program and its
backward as another (the VJP of the same graph), joined to PyTorch autograd
by a `torch.autograd.Function`, so `loss.backward()` and any optimizer work
outside it.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import jax
import torch

from . import executables, modes, steps
from .launch import launch
from .lazy import RECORDER, Lazy
from .state import RNG
from .steps import step_boundary
from .tensor import Storage, TpuTensor
from .transfer import materialize
from .views import apply_chain
from torch.optim.optimizer import register_optimizer_step_pre_hook

_HYPERPARAMETERS = (int, float, bool, tuple)


class Capture:
    """Provenance of graph inputs while a step runs under the recorder."""

    def __init__(self, arg_tensors: dict[int, tuple], state_storages: dict[int, tuple] | None = None):
        self.arg_tensors = arg_tensors  # id(tensor argument) -> its path in (args, kwargs)
        self.owned = dict(state_storages or {})  # id(storage) -> path: module state, base-tensor args
        self.arg_arrays: dict[int, tuple] = {}  # id(array) -> path of the argument
        self.storage_arrays: dict[int, weakref.ref] = {}  # id(array) -> storage
        self.rng_counters: set[int] = set()
        self.rng_bases: set[int] = set()
        self.host_arrays: dict[int, HostConstant] = {}  # id(array) -> a CPU value moved in during the step
        self.problems: list[str] = []
        self.optimizers: list = []
        self.keep: list = []  # arrays noted, kept alive so their ids stay unique

    @classmethod
    def for_arguments(cls, tree, state_storages=None) -> "Capture":
        found = _tensor_paths(tree)
        capture = cls({id(t): path for path, t in found}, state_storages)
        for path, t in found:
            capture.owned.setdefault(id(t._storage_box), ("arg", path))
        return capture

    def read(self, tensor: TpuTensor):
        box = tensor._storage_box
        array = box.array
        if type(array) is not Lazy and id(array) not in self.host_arrays:
            owner = self.owned.get(id(box))
            if owner is not None:
                self.arg_arrays[id(array)] = owner
            else:
                self.storage_arrays[id(array)] = weakref.ref(box)
            self.keep.append(array)
        if not tensor._view_chain:
            return array
        return apply_chain(array, tensor._view_chain)

    def note_rng(self, base, counter) -> None:
        self.rng_bases.add(id(base))
        self.rng_counters.add(id(counter))
        self.keep.extend((base, counter))

    def note_host(self, array, cpu: torch.Tensor) -> None:
        """A CPU tensor moved to the device inside the step (a Python scalar wrapped by PyTorch's
        C++ code, a small constant): a constant of the program, like a Python number."""
        if cpu.numel() > HostConstant.MAX_ELEMENTS:
            self.problems.append(f"it moves a CPU tensor of {cpu.numel()} elements to the device inside the step")
            return
        raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
        self.host_arrays[id(array)] = HostConstant(array, (tuple(cpu.shape), str(cpu.dtype), raw))
        self.keep.append(array)

    def interrupted(self, reason: str) -> None:
        self.problems.append(f"it needs a concrete value mid-step: {reason}")

    def provenance(self, inputs) -> list[tuple]:
        out = []
        for value in inputs:
            key = id(value)
            if key in self.arg_arrays:
                out.append(self.arg_arrays[key])
            elif key in self.host_arrays:
                out.append(("host", self.host_arrays[key]))
            elif key in self.storage_arrays:
                out.append(("storage", self.storage_arrays[key]))
            elif key in self.rng_counters:
                out.append(("rng_counter", None))
            elif key in self.rng_bases:
                out.append(("rng_base", None))
            elif isinstance(value, (float, int)):
                out.append(("number", value))
            else:
                out.append(("constant", None))
                self.problems.append("the step creates device data from the host (a CPU tensor moved inside it)")
        return out


class HostConstant:
    """A small CPU value moved in during a captured step; replays pass the same array, and a
    capture whose host values differ from the last one's is not replayed (see _Plan.key)."""

    MAX_ELEMENTS = 4096

    def __init__(self, array, key: tuple):
        self.array = array
        self.key = key


def _tensor_paths(tree, prefix=()) -> list[tuple[tuple, TpuTensor]]:
    found = []
    if isinstance(tree, TpuTensor):
        found.append((prefix, tree))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            found.extend(_tensor_paths(v, prefix + (i,)))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            found.extend(_tensor_paths(v, prefix + (k,)))
    return found


def _get_path(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _signature(tree):
    """What a replay must match: the structure, and the shape and dtype of each tensor."""
    if isinstance(tree, torch.Tensor):
        return ("T", tuple(tree.shape), tree.dtype, tree.device.type)
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__,) + tuple(_signature(v) for v in tree)
    if isinstance(tree, dict):
        return ("dict",) + tuple((k, _signature(v)) for k, v in sorted(tree.items(), key=lambda kv: str(kv[0])))
    if isinstance(tree, (int, float, bool, str, type(None))):
        return ("V", tree)
    return ("O", id(tree))


def _hyperparameters(optimizers) -> tuple:
    return tuple(
        tuple(tuple((k, v) for k, v in sorted(group.items()) if k != "params" and isinstance(v, _HYPERPARAMETERS))
              for group in opt.param_groups)
        for opt in optimizers
    )


class _Plan:
    """A captured step that can be replayed."""

    def __init__(self, exe, provenance, outputs, return_tree, return_map, optimizers, shardings):
        self.exe = exe
        self.shardings = shardings  # per input: the placement it had at capture (sharded batches)
        self.provenance = provenance
        self.outputs = outputs  # [(weakref to storage, output index)]
        self.return_tree = return_tree
        self.return_map = return_map  # path -> output index
        self.optimizers = [weakref.ref(o) for o in optimizers]
        self.hyper = _hyperparameters(optimizers)

    def key(self):
        numbers = tuple(v.key if kind == "host" else v for kind, v in self.provenance if kind in ("number", "host"))
        return (id(self.exe), numbers)

    def still_valid(self) -> bool:
        optimizers = [r() for r in self.optimizers]
        if any(o is None for o in optimizers):
            return False
        return _hyperparameters(optimizers) == self.hyper

    def run(self, args):
        inputs = []
        drawn = [None]  # the base key of this call's draws
        for kind, value in self.provenance:
            if kind == "arg":
                array = _get_path(args, value).jax()
                wanted = self.shardings[len(inputs)]
                if wanted is not None and array.sharding != wanted:
                    array = jax.device_put(array, wanted)  # as the step's sharding hook placed it
                inputs.append(array)
            elif kind == "storage":
                box = value()
                if box is None:
                    return None
                inputs.append(box.array)
            elif kind in ("rng_counter", "rng_base"):
                inputs.append(_rng_input(kind, drawn))
            elif kind == "host":
                inputs.append(value.array)
            else:
                inputs.append(value)
        values = launch(self.exe, inputs)
        for ref, index in self.outputs:
            box = ref()
            if box is not None:
                box.write(values[index])
        return _rebuild(self.return_tree, self.return_map, values)


def _rng_input(kind: str, drawn: list):
    """A replay's RNG input: a fresh counter (as an op would draw), or the base key it came with."""
    if kind == "rng_counter":
        drawn[0], counter = RNG.next()
        return counter
    return drawn[0] if drawn[0] is not None else RNG.next()[0]


def _rebuild(tree, return_map, values, path=()):
    if path in return_map:
        return TpuTensor(values[return_map[path]])
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(v, return_map, values, path + (i,)) for i, v in enumerate(tree))
    if isinstance(tree, dict):
        return {k: _rebuild(v, return_map, values, path + (k,)) for k, v in tree.items()}
    return tree


class CompiledStep:
    """A step function compiled into one XLA program (see the module docstring)."""

    MAX_CAPTURES = 4

    def __init__(self, fn):
        self.fn = fn
        self.plans: dict[tuple, _Plan] = {}  # argument signature -> replayable plan
        self.candidates: dict[tuple, _Plan] = {}
        self.captures = 0
        self.replays = 0
        self.reason_not_replayed: str | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        call_args = (args, kwargs)
        signature = _signature(call_args)
        plan = self.plans.get(signature)
        if plan is not None and plan.still_valid():
            RECORDER.flush("compiled step")  # inputs must be concrete
            result = plan.run(call_args)
            if result is not None:
                self.replays += 1
                step_boundary("compiled_step")
                return result
        self.plans.pop(signature, None)
        result = self._capture(signature, call_args)
        step_boundary("compiled_step")
        return result

    def _capture(self, signature, call_args):
        if self.reason_not_replayed is not None or modes.get_eager_mode() is modes.EagerMode.DEFER_AND_FUSE:
            with modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE), _steps_suspended():
                return self.fn(*call_args[0], **call_args[1])
        RECORDER.flush("before capture")
        rebased = _RebasedViews(call_args).__enter__()
        capture = Capture.for_arguments(call_args)
        def before_optimizer_step(optimizer, args, kwargs):
            _make_capturable(optimizer)
            capture.optimizers.append(optimizer)

        hook = register_optimizer_step_pre_hook(before_optimizer_step)
        RECORDER.capture = capture
        RECORDER.last_flush = None
        try:
            with modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE), _steps_suspended(), _compiling():
                result = self.fn(*call_args[0], **call_args[1])
                returned = _tensor_paths(result)
                RECORDER.flush("capture end")
        finally:
            RECORDER.capture = None
            hook.remove()
            rebased.__exit__(None, None, None)
        if rebased.written:
            capture.problems.append("it writes into a tensor argument that is a view")
        self.captures += 1
        if RECORDER.last_flush is None:
            return result
        exe, inputs, outputs, storages = RECORDER.last_flush
        provenance = capture.provenance(inputs)
        if capture.problems:
            self._give_up(capture.problems[0])
            return result
        index_of = {id(lz): i for i, lz in enumerate(outputs)}
        out_map = [(weakref.ref(s), index_of[id(lz)]) for s, lz in _pair_storages(storages, outputs)]
        return_map = {}
        for path, t in returned:
            lz = _output_of(t, outputs)
            if lz is None:
                self._give_up("the step returns a tensor that is not an output of its graph (a view)")
                return result
            return_map[path] = index_of[id(lz)]
        optimizers = list(dict.fromkeys(capture.optimizers))
        shardings = [getattr(v, "sharding", None) if kind == "arg" else None
                     for (kind, _), v in zip(provenance, inputs)]
        plan = _Plan(exe, provenance, out_map, result, return_map, optimizers, shardings)
        previous = self.candidates.get(signature)
        if previous is not None and previous.key() == plan.key():
            self.plans[signature] = plan
        elif previous is not None and self.captures >= self.MAX_CAPTURES:
            numbers_changed = previous.exe is plan.exe
            self._give_up("its Python numbers change from call to call" if numbers_changed
                          else "its graph changes from call to call")
        self.candidates[signature] = plan
        return result

    def _give_up(self, reason: str) -> None:
        self.reason_not_replayed = reason
        warnings.warn(f"tpu compile: {getattr(self.fn, '__name__', 'step')} cannot be one program, {reason}; "
                      "it runs fused (traced every call)",
                      stacklevel=4)


def _pair_storages(storages, outputs):
    # Each flushed storage now holds its output's value; pair by that value's identity.
    by_value = {id(lz.value): lz for lz in outputs}
    return [(s, by_value[id(s.array)]) for s in storages if id(s.array) in by_value]


def _output_of(tensor: TpuTensor, outputs):
    by_value = {id(lz.value): lz for lz in outputs}
    if tensor._view_chain:
        return None
    return by_value.get(id(tensor._storage_box.array))


def _make_capturable(optimizer) -> None:
    """Keep Adam-style step counters on the device, so bias corrections are not host numbers.

    Only before the optimizer has state: flipping it later would mix devices.
    """
    if optimizer.state:
        return
    for group in optimizer.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True


class _RebasedViews:
    """During a capture, a tensor argument that is a view (a batch sliced from a dataset)
    stands on its own storage holding its value: the graph takes that value as an input,
    and views the step derives from it chain from it, not from the dataset."""

    def __init__(self, tree):
        self.views = [t for _, t in _tensor_paths(tree) if t._view_chain]
        self.saved = []
        self.written = False

    def __enter__(self):
        for t in self.views:
            with modes.eager_override():  # the value now, outside any graph
                value = t.jax()
                if type(value) is Lazy:
                    value = materialize(t)
            box = Storage(value)
            self.saved.append((t, t._storage_box, t._view_chain, box))
            t._storage_box, t._view_chain, t._cache, t._cache_version = box, (), box.array, box.version
        return self

    def __exit__(self, *exc):
        for t, old_box, chain, box in self.saved:
            t._storage_box, t._view_chain, t._cache_version = old_box, chain, -1
            if box.version:
                self.written = True
                t.set_jax(box.array)
        return False


class _steps_suspended:
    """Inside a captured step the optimizer's hook must not end the step early."""

    def __enter__(self):
        self._old = steps.suspended
        steps.suspended = True

    def __exit__(self, *exc):
        steps.suspended = self._old
        return False


class _compiling:
    """While a step is captured, `torch.compiler.is_compiling()` is True, as under torch.compile:
    library code written for compilation then avoids host reads of device values (transformers
    builds an explicit mask instead of checking `padding_mask.all()`; optimizers keep step
    counters on the device). Same math, one program."""

    def __enter__(self):
        self._old = torch.compiler.is_compiling
        torch.compiler.is_compiling = _true

    def __exit__(self, *exc):
        torch.compiler.is_compiling = self._old
        return False


def _true() -> bool:
    return True


# --------------------------------------------------------------------------
# torch.compile(module): forward and backward programs joined to autograd
# --------------------------------------------------------------------------


class CompiledModule(torch.nn.Module):
    """`torch.compile(model)` on the tpu device."""

    def __init__(self, module: torch.nn.Module, call=None):
        super().__init__()
        self._orig_mod = module
        # What computes the forward: the module itself, or (when its own `forward` is being
        # replaced by this one) its original forward method.
        self._call = call if call is not None else module
        self._programs: dict[tuple, _ForwardProgram] = {}

    def forward(self, *args, **kwargs):
        state = dict(self._orig_mod.named_parameters()) | dict(self._orig_mod.named_buffers())
        signature = (_signature((args, kwargs)), self._orig_mod.training,
                     tuple((k, tuple(v.shape), v.dtype) for k, v in state.items()))
        program = self._programs.get(signature)
        if program is None:
            program = _ForwardProgram.capture(self._orig_mod, self._call, args, kwargs)
            if program is None:  # not capturable as a pure function: run it eagerly
                return self._call(*args, **kwargs)
            self._programs[signature] = program
        return program(self._orig_mod, args, kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


class _ForwardProgram:
    def __init__(self, graph, provenance, result_tree, return_map, buffer_updates, n_outputs):
        self.graph = graph  # pure function of the inputs, in provenance order
        self.provenance = provenance
        self.result_tree = result_tree
        self.return_map = return_map
        self.buffer_updates = buffer_updates  # [(buffer name, output index)]
        self.n_outputs = n_outputs
        self.forward_exe = None
        self.backward_exe = None

    @classmethod
    def capture(cls, module, call, args, kwargs):
        RECORDER.flush("before capture")
        named = dict(module.named_parameters()) | dict(module.named_buffers())
        state = {id(t._storage_box): ("state", name) for name, t in named.items() if isinstance(t, TpuTensor)}
        rebased = _RebasedViews((args, kwargs)).__enter__()
        capture = Capture.for_arguments((args, kwargs), state)
        RECORDER.capture = capture
        RECORDER.last_flush = None
        try:
            with torch.no_grad(), modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE), _steps_suspended(), \
                    _compiling():
                result = call(*args, **kwargs)
                returned = _tensor_paths(result)
                RECORDER.flush("capture end")
        finally:
            RECORDER.capture = None
            rebased.__exit__(None, None, None)
        if RECORDER.last_flush is None or capture.problems:
            return None
        exe, inputs, outputs, storages = RECORDER.last_flush
        provenance = []
        for kind, value in capture.provenance(inputs):
            if kind in ("arg", "state"):
                provenance.append((kind, value))
            elif kind == "number":
                provenance.append(("number", value))
            elif kind in ("rng_counter", "rng_base"):
                provenance.append((kind, None))
            else:
                return None
        if capture.problems:
            return None
        index_of = {id(lz): i for i, lz in enumerate(outputs)}
        return_map = {}
        for path, t in returned:
            lz = _output_of(t, outputs)
            if lz is None:
                return None
            return_map[path] = index_of[id(lz)]
        names_by_storage = {id(t._storage_box): name for name, t in named.items()}
        buffer_updates = [(names_by_storage[id(s)], index_of[id(lz)])
                          for s, lz in _pair_storages(storages, outputs) if id(s) in names_by_storage]
        return cls(exe.raw, provenance, result, return_map, buffer_updates, len(outputs))

    def _inputs(self, module, args, kwargs):
        named = dict(module.named_parameters()) | dict(module.named_buffers())
        tensors, numbers = [], []
        drawn = [None]  # the base key of this call's draws
        for kind, value in self.provenance:
            if kind == "state":
                tensors.append(named[value])
            elif kind == "arg":
                tensors.append(_get_path((args, kwargs), value))
            elif kind in ("rng_counter", "rng_base"):
                numbers.append(_rng_input(kind, drawn))
            else:
                numbers.append(value)
        return tensors, numbers

    def __call__(self, module, args, kwargs):
        tensors, numbers = self._inputs(module, args, kwargs)
        outputs = _GraphFunction.apply(self, numbers, *tensors)
        named = dict(module.named_buffers())
        with torch.no_grad():
            for name, index in self.buffer_updates:
                named[name]._storage_box.write(outputs[index].jax())
        return _rebuild_tensors(self.result_tree, self.return_map, outputs)

    def split(self, numbers):
        """The graph as f(tensor inputs) with numbers bound, for jit and vjp."""
        kinds = [kind for kind, _ in self.provenance]
        graph = self.graph

        def f(*tensors):
            it_t, it_n = iter(tensors), iter(numbers)
            args = [next(it_t) if kind in ("state", "arg") else next(it_n) for kind in kinds]
            return tuple(graph(*args))

        return f


def _rebuild_tensors(tree, return_map, outputs, path=()):
    if path in return_map:
        return outputs[return_map[path]]
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild_tensors(v, return_map, outputs, path + (i,)) for i, v in enumerate(tree))
    if isinstance(tree, dict):
        return {k: _rebuild_tensors(v, return_map, outputs, path + (k,)) for k, v in tree.items()}
    return tree


class _GraphFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program: _ForwardProgram, numbers, *tensors):
        arrays = [materialize(t) for t in tensors]  # inside fused mode, pending inputs run first
        fwd = _jitted(program, "forward", len(numbers))
        values = fwd(tuple(numbers), *arrays)
        ctx.program, ctx.numbers = program, numbers
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)  # PyTorch would make zeros on our wrapper's device (meta)
        outputs = tuple(TpuTensor(v) for v in values)
        ctx.mark_non_differentiable(*[outputs[i] for _, i in program.buffer_updates])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        program = ctx.program
        arrays = [materialize(t) for t in tensors]
        cotangents = []
        for g, out in zip(grads, program.out_avals):
            if not isinstance(g, TpuTensor):
                cotangents.append(jax.numpy.zeros(out.shape, out.dtype))
            else:
                cotangents.append(materialize(g))
        bwd = _jitted(program, "backward", len(ctx.numbers))
        input_grads = bwd(tuple(ctx.numbers), tuple(arrays), tuple(cotangents))
        out = [None, None]
        for t, g in zip(tensors, input_grads):
            out.append(TpuTensor(g) if t.requires_grad and jax.numpy.issubdtype(g.dtype, jax.numpy.floating) else None)
        return tuple(out)


def _jitted(program: _ForwardProgram, which: str, n_numbers: int):
    cached = getattr(program, f"_{which}", None)
    if cached is not None:
        return cached

    def forward(numbers, *arrays):
        return program.split(numbers)(*arrays)

    def backward(numbers, arrays, cotangents):
        f = program.split(numbers)
        _, vjp = jax.vjp(f, *arrays)
        grads = vjp(tuple(cotangents))
        return tuple(
            g if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else jax.numpy.zeros(a.shape, a.dtype)
            for g, a in zip(grads, arrays)
        )

    fn = jax.jit(forward if which == "forward" else backward)
    if which == "forward":
        program.out_avals = None

        def run(numbers, *arrays):
            if program.out_avals is None:
                program.out_avals = jax.eval_shape(forward, numbers, *arrays)
                _register(program, "forward", fn, (numbers, *arrays))
            return launch(program.forward_exe, (numbers, *arrays))
    else:
        def run(numbers, arrays, cotangents):
            if program.backward_exe is None:
                _register(program, "backward", fn, (numbers, arrays, cotangents))
            return launch(program.backward_exe, (numbers, arrays, cotangents))
    setattr(program, f"_{which}", run)
    return run


def _register(program, which, fn, args):
    exe = executables.Executable(
        name=f"compiled_module_{which}", kind="compiled", fn=fn,
        args=jax.tree_util.tree_map(executables.abstract, args),
    )
    executables.register(exe)
    if which == "forward":
        program.forward_exe = exe
    else:
        program.backward_exe = exe


# --------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------


def compile(fn=None, **options):  # noqa: A001 - mirrors torch.compile
    """Compile a step function or a module for the tpu device."""
    if fn is None:
        return lambda f: compile(f, **options)
    if isinstance(fn, torch.nn.Module):
        return CompiledModule(fn)
    return CompiledStep(fn)


def _uses_tpu(fn) -> bool:
    if isinstance(fn, torch.nn.Module):
        return any(isinstance(p, TpuTensor) for p in fn.parameters()) or any(
            isinstance(b, TpuTensor) for b in fn.buffers())
    return False


def patch_torch_compile() -> None:
    """`torch.compile` with the tpu backend named, or no backend and tpu tensors, takes our path."""
    original = torch.compile
    if getattr(original, "_tpu_agent", False):
        return

    def tpu_compile(model=None, *, backend=None, **kwargs):
        if model is None:
            return lambda m: tpu_compile(m, backend=backend, **kwargs)
        if backend == "tpu" or (backend is None and _uses_tpu(model)):
            return compile(model)
        if backend is None and not isinstance(model, torch.nn.Module):
            return _Deferred(model, original, kwargs)
        return original(model, **kwargs) if backend is None else original(model, backend=backend, **kwargs)

    tpu_compile._tpu_agent = True
    tpu_compile.__doc__ = original.__doc__
    torch.compile = tpu_compile


class _Deferred:
    """A function compiled with no backend named: its first call's tensors choose the path."""

    def __init__(self, fn, original, kwargs):
        self._fn, self._original, self._kwargs = fn, original, kwargs
        self._target = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self._target is None:
            on_tpu = bool(_tensor_paths((args, kwargs))) or _closure_uses_tpu(self._fn)
            self._target = compile(self._fn) if on_tpu else self._original(self._fn, **self._kwargs)
        return self._target(*args, **kwargs)


def _closure_uses_tpu(fn) -> bool:
    """A step function usually closes over its model and optimizer rather than taking them."""
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _cell_ok(c)]
    values = cells + [v for v in getattr(fn, "__globals__", {}).values() if isinstance(v, torch.nn.Module)]
    return any(_uses_tpu(v) for v in values if isinstance(v, torch.nn.Module))


def _cell_ok(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False

