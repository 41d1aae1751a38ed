"""A step function as one XLA program: `torch.compile(step_fn)` on the tpu device.

The step runs under the fused recorder, which yields one graph for forward,
backward and optimizer update, and notes where each graph input came from (see
capture.py). Once two consecutive captures give the same graph and the same
Python numbers, later calls replay the compiled program directly: inputs are
read from those tensors, outputs written back, and no Python of the step runs,
so per-op overhead disappears.

Like `torch.compile`, replay treats Python values read in the step as
constants. A step is re-captured when its tensor arguments change shape or
dtype, or an optimizer's hyperparameters (lr, betas, ...) change; a step that
reads a device value on the host (`.item()`), moves data from the CPU, or
whose Python numbers change from call to call is re-traced on every call
(fused mode), and the reason is kept in `reason_not_replayed`.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref

import jax
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core import executables, lazy, modes, steps
from . import whole_step
from .capture import (Capture, RebasedViews, autocast_state, compiling, constant_input, get_path, output_of,
                      pair_storages, rebuild, replay_key, signature, tensor_paths)
from ..core.launch import launch
from ..core.lazy import RECORDER
from ..core.state import STATE
from ..core.steps import step_boundary
from ..core.transfer import materialize
from .whole_step import recording

_HYPERPARAMETERS = (int, float, bool, tuple)
STALE = object()  # a replay found a storage it reads gone: capture again
UNRECORDED = object()  # a replay that cannot be a node of the pending graph: launch it


# References to an input array that only its storage holds: the storage, the input list, and
# getrefcount's own argument. Any more (a tensor sharing it through `copy_`, a view's cached value,
# a pending graph) and donating it would delete a value someone can still read.
_STORAGE_REFS = 3


def _hyperparameters(optimizers, varying=()) -> tuple:
    """What a replay must find unchanged in the optimizers (`varying` keys are inputs of the program)."""
    return tuple(
        tuple(tuple((k, v) for k, v in sorted(group.items())
                    if k != "params" and k not in varying and isinstance(v, _HYPERPARAMETERS))
              for group in opt.param_groups)
        for opt in optimizers
    )


class Plan:
    """A captured step that can be replayed."""

    def __init__(self, exe, provenance, outputs, return_tree, return_map, optimizers, shardings, varying=()):
        self.exe = exe
        self.shardings = shardings  # per input: the placement it had at capture (sharded batches)
        self.provenance = provenance
        self.outputs = outputs  # [(weakref to storage, output index)]
        self.return_tree = return_tree
        self.return_map = return_map  # path -> output index
        self.optimizers = [weakref.ref(o) for o in optimizers]
        self.varying = varying
        self.hyper = _hyperparameters(optimizers, varying)
        # Inputs read from a storage the step writes back (parameters, optimizer state): their old
        # arrays die with the replay, so XLA may update them in place (see _donating).
        written = {id(ref()) for ref, _ in outputs if ref() is not None}
        self.donatable = tuple(i for i, (kind, value) in enumerate(provenance)
                               if kind == "storage" and value() is not None and id(value()) in written)
        if getattr(exe.fn, "ranks", None) is not None:  # one program over the ranks (collectives): not re-jitted
            self.donatable = ()
        out_index = {id(ref()): index for ref, index in outputs if ref() is not None}
        self.replaced_by = {i: out_index[id(provenance[i][1]())] for i in self.donatable}  # input -> its output
        self._donating: executables.Executable | None = None
        self._node: lazy.Program | None = None  # the program as a node of a compiled-steps window's graph

    def _donating_exe(self) -> executables.Executable:
        """The same program with the written storages' inputs donated: on a CPU this halved an AdamW
        update of 3M parameters (no fresh pages for every new array), on a TPU it saves their memory."""
        if self._donating is None:
            exe = self.exe
            self._donating = executables.register(executables.Executable(
                name=exe.name, kind=exe.kind, fn=jax.jit(exe.raw, donate_argnums=self.donatable), args=exe.args,
                source=exe.source, ops=exe.ops, raw=exe.raw))
        return self._donating

    def key(self) -> tuple:
        return replay_key(self.exe, self.provenance)

    def still_valid(self) -> bool:
        optimizers = [r() for r in self.optimizers]
        if any(o is None for o in optimizers):
            return False
        return _hyperparameters(optimizers, self.varying) == self.hyper

    def changed(self) -> str:
        """What made `still_valid` false, in words."""
        optimizers = [r() for r in self.optimizers]
        if any(o is None for o in optimizers):
            return "an optimizer it updates was deleted"
        now = _hyperparameters(optimizers, self.varying)
        names = sorted({k for groups_now, groups_then in zip(now, self.hyper)
                        for g_now, g_then in zip(groups_now, groups_then)
                        for (k, v) in set(g_now) ^ set(g_then)})
        return f"hyperparameter {', '.join(names)} changed (a constant of its program)" if names else \
            "its parameter groups changed"

    def _donatable_now(self, inputs) -> bool:
        if not self.donatable:
            return False
        for i in self.donatable:
            if sys.getrefcount(inputs[i]) > _STORAGE_REFS:
                return False
        return True

    def _inputs(self, args, read_arg):
        """The program's inputs for this call (`read_arg(tensor, index)` reads an argument), or STALE."""
        inputs = []
        drawn = [None]  # the base key of this call's draws
        for kind, value in self.provenance:
            if kind == "arg":
                inputs.append(read_arg(get_path(args, value), len(inputs)))
            elif kind == "storage":
                box = value()
                if box is None:
                    return STALE
                inputs.append(box.array)
            else:
                inputs.append(constant_input(kind, value, drawn))
        return inputs

    def _placed(self, tensor, index):
        # fused work may still be pending on it (a model that ran as written, its grads unrun)
        array = materialize(tensor)
        wanted = self.shardings[index]
        if wanted is not None and array.sharding != wanted:
            array = jax.device_put(array, wanted)  # as the step's sharding hook placed it
        return array

    def run(self, args):
        inputs = self._inputs(args, self._placed)
        if inputs is STALE:
            return STALE
        values = launch(self._donating_exe() if self._donatable_now(inputs) else self.exe, inputs)
        return self._write_back(values)

    def record(self, args):
        """As `run`, recorded as one node of the pending graph (compiled steps' window, whole_step.py): inputs may
        be pending values, outputs are. STALE as `run`; UNRECORDED under a device mesh (inputs are placed as
        captured, which a pending value cannot be)."""
        if STATE.mesh is not None or getattr(self.exe.fn, "ranks", None) is not None:  # or it holds collectives
            return UNRECORDED
        inputs = self._inputs(args, lambda tensor, index: tensor.jax())
        if inputs is STALE:
            return STALE
        if self._node is None:
            self._node = lazy.Program(executables.next_id(), self.exe.name, self.exe.raw, {}, scope=self.exe.name)
        values = RECORDER.record(self._node, inputs)
        # Each donatable input with the output that replaces it: the flush aliases the two (lazy.Recorder.donate).
        RECORDER.donate.update((id(inputs[i]), values[self.replaced_by[i]]) for i in self.donatable
                               if type(inputs[i]) is not lazy.Lazy)
        return self._write_back(values)

    def _write_back(self, values):
        for ref, index in self.outputs:
            box = ref()
            if box is not None:
                box.write(values[index])
        return rebuild(self.return_tree, self.return_map, values)



class CompiledStep:
    """A step function compiled into one XLA program (see the module docstring)."""

    MAX_CAPTURES = 4

    def __init__(self, fn, marks_steps: bool = True, capture_when_fused: bool = False, varying: tuple = (),
                 name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "step")
        self.varying = varying  # optimizer hyperparameters the step takes as inputs, not constants
        self.marks_steps = marks_steps  # False: a part of a step (an optimizer's update), marked by its caller
        self.capture_when_fused = capture_when_fused  # True: capture even when the caller runs fused
        self.plans: dict[tuple, Plan] = {}  # argument signature -> replayable plan
        self.candidates: dict[tuple, Plan] = {}
        self.captures = 0
        self.replays = 0
        self.interrupted = False  # a capture was interrupted mid-step (a host read) once already
        self.reason_not_replayed: str | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if steps.suspended():
            # Inside another compiled step (an optimizer's update inside a torch.compile'd step under compiled
            # steps), captured or traced: its ops are that step's program's; a capture of its own would flush it.
            return self.fn(*args, **kwargs)
        call_args = (args, kwargs)
        key = (signature(call_args), autocast_state())
        plan = self.plans.get(key)
        valid = plan is not None and plan.still_valid()
        if plan is not None and not valid:
            whole_step.WINDOW.recapture_reasons.append(f"{self.name} captured again: {plan.changed()}")
        if valid:
            result = plan.record(call_args) if self.capture_when_fused and recording() else UNRECORDED
            if result is UNRECORDED:
                RECORDER.flush("compiled step")  # inputs must be concrete
                result = plan.run(call_args)
            if result is not STALE:
                self.replays += 1
                self._end()
                return result
        self.plans.pop(key, None)
        result = self._capture(key, call_args)
        self._end()
        return result

    def _end(self) -> None:
        if self.marks_steps:
            step_boundary("compiled_step")

    def _fused_only(self) -> bool:
        """Run traced every call: replay was given up, or the caller asked for fused mode."""
        if self.reason_not_replayed is not None:
            return True
        return not self.capture_when_fused and modes.get_eager_mode() is modes.EagerMode.DEFER_AND_FUSE

    def _capture(self, key, call_args):
        whole_step.WINDOW.captures += 1
        if self._fused_only():
            with modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE), steps.suspend():
                return self.fn(*call_args[0], **call_args[1])
        RECORDER.flush("before capture")
        rebased = RebasedViews(call_args).__enter__()
        capture = Capture.for_arguments(call_args)
        capture.optimizers.extend(a for a in call_args[0] if isinstance(a, torch.optim.Optimizer))

        def before_optimizer_step(optimizer, args, kwargs):
            make_capturable(optimizer)
            capture.optimizers.append(optimizer)

        hook = register_optimizer_step_pre_hook(before_optimizer_step)
        RECORDER.capture = capture
        RECORDER.last_flush = None
        try:
            with modes.set_eager_mode(modes.EagerMode.DEFER_AND_FUSE), steps.suspend(), compiling():
                result = self.fn(*call_args[0], **call_args[1])
                returned = tensor_paths(result)
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
            # A step interrupted once is captured again: DDP reads its bucket order on the host once, in its
            # second step (it rebuilds its buckets); a second interruption is the step's own.
            if self.interrupted or not capture.problems[0].startswith(Capture.INTERRUPTED):
                self._give_up(capture.problems[0])
            self.interrupted = True
            return result
        index_of = {id(lz): i for i, lz in enumerate(outputs)}
        out_map = [(weakref.ref(s), index_of[id(lz)]) for s, lz in pair_storages(storages, outputs)]
        return_map = {}
        for path, t in returned:
            lz = output_of(t, outputs)
            if lz is None:
                self._give_up("the step returns a tensor that is not an output of its graph (a view)")
                return result
            return_map[path] = index_of[id(lz)]
        optimizers = list(dict.fromkeys(capture.optimizers))
        shardings = [getattr(v, "sharding", None) if kind == "arg" else None
                     for (kind, _), v in zip(provenance, inputs)]
        plan = Plan(exe, provenance, out_map, result, return_map, optimizers, shardings, self.varying)
        previous = self.candidates.get(key)
        if previous is not None and previous.key() == plan.key():
            self.plans[key] = plan
        elif previous is not None and self.captures >= self.MAX_CAPTURES:
            numbers_changed = previous.exe is plan.exe
            self._give_up("its Python numbers change from call to call" if numbers_changed
                          else "its graph changes from call to call")
        self.candidates[key] = plan
        return result

    def _give_up(self, reason: str) -> None:
        self.reason_not_replayed = reason
        warnings.warn(f"tpu compile: {self.name} cannot be one program, {reason}; "
                      "it runs fused (traced every call)",
                      stacklevel=4)



def make_capturable(optimizer) -> None:
    """Keep Adam-style step counters on the device, so bias corrections are not host numbers; Adam and
    AdamW run their fused update (one op, the CPU's bias corrections: ops/optim.py).

    Only before the optimizer has state: flipping it later would mix devices.
    """
    if optimizer.state:
        return
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    for group in optimizer.param_groups:
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
        if adam and not group["differentiable"] and all(p.is_floating_point() for p in group["params"]):
            # The fused update, as the CPU computes it: the capturable form's float32 `beta ** step`
            # drifted 2.5e-6 relative from the CPU's losses in 20 steps (ops/optim.py; issue #28).
            group["fused"] = True


