"""Compiled steps with no change to the script.

`TPU_AGENT_COMPILE_STEPS=1` (or `torch.tpu.compile_steps()`) turns an
unmodified loop (forward, `loss.backward()`, gradient clipping,
`optimizer.step()`, an LR scheduler, `zero_grad()`) into one XLA program per
step: the outermost tpu module's forward and backward (module_program.py) and
each optimizer's update (optimizer_program.py) are captured once, then
recorded as single nodes of the step's fused graph, which the step's boundary
runs as one program (whole_step.py). In steady state no per-op Python runs for
the model or the optimizer.

The model is found at its first call: the first module called whose
parameters are on the tpu device is the outermost one. Each optimizer is found
at its first `step()`, which runs as written (it creates the optimizer's state);
later steps replay.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tpu_agent import envvars


class _State:
    """The switch's one piece of state: its hooks while on, and what it compiled."""

    def __init__(self) -> None:
        self.module_hook = None
        self.optimizer_hook = None
        self.modules: list = []  # CompiledModule per model found
        self.optimizers: list = []  # OptimizerProgram per optimizer found

    @property
    def on(self) -> bool:
        return self.optimizer_hook is not None


STATE = _State()


def compile_steps(on: bool = True, *, freeze_gc: bool = True) -> None:
    """Switch compiled steps on (from the next model call and optimizer step) or off (for models and
    optimizers not yet found; those already compiled stay compiled). `freeze_gc`: once the step stops compiling,
    collect and freeze Python's garbage collector's objects until the next compile (whole_step.py says why)."""
    from . import whole_step

    whole_step.FREEZE_GC = freeze_gc
    if on and not STATE.on:
        from .optimizer_program import install_clip

        install_clip()  # clip_grad_norm_ as one node of a step's graph (as written outside compiled steps)
        STATE.module_hook = torch.nn.modules.module.register_module_forward_pre_hook(_first_forward)
        STATE.optimizer_hook = register_optimizer_step_pre_hook(_first_step)
    elif not on and STATE.on:
        from .whole_step import WINDOW

        WINDOW.end("compile_steps off")  # the user's mode back now; what was found keeps opening windows
        WINDOW.thaw()
        if STATE.module_hook is not None:
            STATE.module_hook.remove()
        STATE.optimizer_hook.remove()
        STATE.module_hook = STATE.optimizer_hook = None


def enable_from_environment() -> None:
    if envvars.COMPILE_STEPS.value:
        compile_steps(True)


def compile_module(module: torch.nn.Module, whole_step: bool = False):
    """Replace `module.forward` with a compiled one (forward and backward programs); returns it. `whole_step`:
    a call with gradients opens a step window, so the step runs as one program (whole_step.py)."""
    from .module_program import CompiledModule
    from .whole_step import WINDOW

    if whole_step:
        WINDOW.new_model()
    compiled = CompiledModule(module, call=type(module).forward.__get__(module))
    compiled.whole_step = whole_step
    module.forward = compiled.forward
    _leave_compiled_forwards_out_of_pickles()
    STATE.modules.append(compiled)
    return compiled


def _leave_compiled_forwards_out_of_pickles() -> None:
    """`torch.save(model)` and `copy.deepcopy(model)` of a model compiled here give the model as written: the
    compiled forward in its `__dict__` is left out, as `nn.Module.__getstate__` leaves out what `module.compile()`
    sets. (Before, the pickle held the compiled programs, and the copy's forward ran the original's.)"""
    original = torch.nn.Module.__getstate__
    if getattr(original, "_tpu_agent", False):
        return
    from .module_program import CompiledModule

    def getstate(self):
        state = original(self)
        forward = state.get("forward")
        if isinstance(getattr(forward, "__self__", None), CompiledModule):
            state = dict(state)
            del state["forward"]
        return state

    getstate._tpu_agent = True
    torch.nn.Module.__getstate__ = getstate


def _first_forward(module, args):
    from .module_program import CompiledModule
    from ..core.tensor import TpuTensor

    if isinstance(module, CompiledModule) or "forward" in module.__dict__:
        return None  # compiled already, by the script (torch.compile) or by us
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return None  # DDP's own forward (its reducer's bookkeeping) runs as written; the model it wraps, next
    # called, is the one compiled
    param = next(module.parameters(), None)
    if not isinstance(getattr(param, "_local_tensor", param), TpuTensor):  # a DTensor's (FSDP2, TP): its shard
        return None
    STATE.module_hook.remove()  # the first tpu module called is the outermost one
    STATE.module_hook = None
    compile_module(module, whole_step=True)  # from its next call on: this call looked its forward up already
    return None


def _first_step(optimizer, args, kwargs):
    from .optimizer_program import install

    if "_tpu_program" in optimizer.__dict__:
        return None
    if not any(_on_tpu(p) for group in optimizer.param_groups for p in group["params"]):
        return None
    program = install(optimizer)
    if program is not None:
        STATE.optimizers.append(program)
    return None


def _on_tpu(p) -> bool:
    return getattr(p, "device", None) is not None and p.device.type == "tpu"
