"""Running a training script on the meta device and recording one step's aten ops as a graph.

Every tensor the script makes on `tpu` (and every tensor made without a device) lives on `meta`: shapes and
dtypes only, so a 70B-parameter model costs no memory. A `TorchDispatchMode` records each aten op with its
arguments (tensors as value ids) between two optimizer steps; tensors that existed before the step are the
graph's inputs (parameters, optimizer state, the batch). A value read on the host (`.item()`) is a made-up
1.0: the step's shapes must not depend on data.
"""

from __future__ import annotations

import os
import runpy
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_SKIP = {aten._local_scalar_dense.default}
_IGNORED_NAMESPACES = ("profiler",)
_DRAWS = {aten.randint, aten.randn, aten.rand, aten.randperm, aten.normal}


class StopScript(BaseException):
    """Raised at the step boundary once the wanted steps are recorded (the script's `except Exception` passes it)."""


@dataclass(frozen=True)
class Ref:
    """A tensor in a recorded op's arguments: its value id."""

    vid: int


@dataclass
class Node:
    func: object  # an aten OpOverload (or one of attention.py's ops)
    args: tuple
    kwargs: dict
    outs: list  # value ids of the flattened outputs (None where not a tensor)
    written: list = field(default_factory=list)  # (argument name, value id before, value id after)
    out_shapes: list = field(default_factory=list)  # shapes of the flattened outputs (None where not a tensor)
    backward: bool = False  # recorded while autograd ran the backward pass


@dataclass
class Graph:
    nodes: list
    inputs: dict  # value id -> (shape, dtype, role, name)
    outputs: list  # value ids live after the step: the new values of inputs it wrote
    blocks: int | None = None  # repeated blocks present when recorded (None: no truncation)
    block_inputs: set = field(default_factory=set)  # value ids of the repeated blocks' inputs (hidden states)


META_DEVICES = {"tpu"}  # devices read as meta; partition.py adds a --device-map's source (cuda)


def _device(value):
    if isinstance(value, torch.device) and value.type in META_DEVICES:
        return torch.device("meta")
    if isinstance(value, str) and value.split(":")[0] in META_DEVICES:
        return "meta"
    return value


class MetaDevice(TorchFunctionMode):
    """Every `tpu` a torch call names is read as `meta` (`device=`, `.to(...)`, `torch.device(...)`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda and "cuda" in META_DEVICES:  # a --device-map cuda=tpu script's x.cuda()
            return args[0].to("meta")
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _device(args[1]), *args[2:])
        elif func is torch._C._nn._parse_to and args:
            args = (_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _device(kwargs["device"])
        elif isinstance(kwargs.get("generator"), torch.Generator) and kwargs["generator"].device.type == "cpu":
            kwargs["device"] = "cpu"  # host-side draws (a sampler's randperm): indices the script reads back
        return func(*args, **kwargs)


class Recorder(TorchDispatchMode):
    def __init__(self, lowerable=None):
        super().__init__()
        self.lowerable = lowerable  # func -> bool: ops it cannot lower are decomposed while recording
        self.active = False
        self.nodes: list[Node] = []
        self.vids: dict[int, int] = {}  # id(tensor) -> current value id
        self.keep: list = []  # tensors seen, kept alive so their ids stay unique
        self.inputs: dict[int, torch.Tensor] = {}  # value id -> tensor existing before the step
        self.next = 0
        self.batch = None  # --per-chip-batch: the global batch the step's batch tensors are given instead
        self.script_batch = None  # dim 0 of the first batch tensor the script made in a recorded step
        self.resized = 0
        self.block_inputs: set = set()

    def start(self):
        self.active, self.nodes, self.vids, self.keep, self.inputs = True, [], {}, [], {}
        self.block_inputs = set()

    def mark_block_input(self, module, args, kwargs):
        """A repeated block's forward pre-hook: its input (the hidden states) is what a framework offloads to the
        host when told to (MaxText's decoder_layer_input=offload; partition.py counts it against host memory)."""
        x = args[0] if args else kwargs.get("hidden_states")
        if self.active and isinstance(x, torch.Tensor) and id(x) in self.vids:
            self.block_inputs.add(self.vids[id(x)])

    def _new(self, tensor) -> int:
        self.next += 1
        self.vids[id(tensor)] = self.next
        self.keep.append(tensor)
        return self.next

    def ref(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        vid = self.vids.get(id(value))
        if vid is None:
            vid = self._new(value)
            self.inputs[vid] = value
        return Ref(vid)

    def _rebatched(self, tensor):
        """With --per-chip-batch, a batch tensor of the step with dim 0 set to the global batch (a fresh meta
        tensor: its values are never read)."""
        if self.batch is None or tensor.dim() == 0:
            return tensor
        if self.script_batch is None:
            self.script_batch = tensor.shape[0]
        if tensor.shape[0] != self.script_batch:
            return tensor
        self.resized += 1
        return torch.empty((self.batch, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SKIP:
            return 1.0
        if not self.active or func.namespace in _IGNORED_NAMESPACES:
            return func(*args, **kwargs)
        if self.lowerable is not None and not self.lowerable(func):
            from torch._decomp import decomposition_table

            decomposition = decomposition_table.get(func)
            if decomposition is None and hasattr(func, "decompose"):
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            elif decomposition is not None:
                with self:
                    return decomposition(*args, **kwargs)
        if func.overloadpacket in _DRAWS and not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0]):
            out = func(*args, **kwargs)  # a batch drawn on the device: an input of the step, like a loaded one
            out = self._rebatched(out)
            self.ref(out)
            return out
        if (self.batch is not None and func is aten._to_copy.default and isinstance(args[0], torch.Tensor)
                and args[0].device.type != "meta"):
            out = func(*args, **kwargs)  # a batch loaded on the host and moved to the device
            if isinstance(out, torch.Tensor) and out.device.type == "meta":
                out = self._rebatched(out)
                self.ref(out)
                return out
        rargs, rkwargs = tree_map(self.ref, args), tree_map(self.ref, kwargs)
        before = {}
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(a.name)
                    before[a.name] = value
        out = func(*args, **kwargs)
        written = []
        for name, value in before.items():
            for tensor in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(tensor, torch.Tensor):
                    old = self.ref(tensor).vid
                    written.append((name, old, self._new(tensor)))
        flat, _ = tree_flatten(out)
        writes = {id(t) for v in before.values() for t in (v if isinstance(v, (list, tuple)) else [v])}
        outs = []
        for t in flat:
            if isinstance(t, torch.Tensor):
                outs.append(self.vids[id(t)] if id(t) in writes else self._new(t))
            else:
                outs.append(None)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in flat]
        backward = torch._C._current_graph_task_id() != -1
        self.nodes.append(Node(func, rargs, rkwargs, outs, written, shapes, backward))
        return out


def repeated_blocks(modules) -> tuple[object, str] | None:
    """The largest `nn.ModuleList` of two or more blocks of one class with equal parameter shapes."""
    best, best_size = None, 0
    for root in modules:
        for name, module in root.named_modules():
            if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
                continue
            shapes = {(type(b), tuple(tuple(p.shape) for p in b.parameters())) for b in module}
            size = sum(p.numel() for p in module.parameters())
            if len(shapes) == 1 and size > best_size:
                best, best_size = (module, name), size
    return best


def _modules_of(optimizer) -> list:
    import gc
    import weakref

    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    found = []
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if type(o) in weakref.ProxyTypes:  # isinstance on a dead proxy raises ReferenceError
                continue
            if isinstance(o, torch.nn.Module) and any(id(p) in params for p in o.parameters()):
                found.append(o)
    # the outermost modules: not a child of another found module
    children = {id(c) for m in found for c in m.modules() if c is not m}
    return [m for m in found if id(m) not in children]


@dataclass
class Recording:
    graphs: list  # one Graph per recorded step (blocks kept: all, or 2 then 1)
    names: dict  # id(tensor) -> parameter name, for the inputs
    blocks_total: int | None
    blocks_name: str | None
    batch_rows: int | None = None


def record(script: str, args: list[str], scale_layers: bool = True, lowerable=None, batch: int | None = None,
           batch_option: str = "--per-chip-batch") -> Recording:
    """Run `script` on meta; record step 2 (with every block, or 2 blocks) and step 3 (1 block). `batch`: the
    global batch the recorded steps' batch tensors (drawn on the device, or moved there) get in dim 0."""
    from tpu_agent.errors import InputError

    from . import attention, distributed

    torch.autograd.set_multithreading_enabled(False)
    recorder = Recorder(lowerable)
    recorder.batch = batch
    state = {"step": 0, "graphs": [], "names": {}, "blocks": None, "modules": None}
    plan = [None]  # blocks kept for each recorded step
    if scale_layers:
        plan = [2, 1]

    def finish_graph():
        inputs = {}
        for vid, tensor in recorder.inputs.items():
            name = state["names"].get(id(tensor))
            role = "data" if not name else name.split(":")[0] if ":" in name else "param"
            role = {"buffer": "buffer"}.get(role, role)
            inputs[vid] = (tuple(tensor.shape), tensor.dtype, role, name)
        live = {}
        for tensor_id, vid in recorder.vids.items():
            live[tensor_id] = vid
        first = {id(t): vid for vid, t in recorder.inputs.items()}
        outputs = [live[tid] for tid, vid0 in first.items() if live.get(tid, vid0) != vid0]
        kept = len(state["blocks"][0]) if state["blocks"] else None
        return Graph(recorder.nodes, inputs, outputs, kept, set(recorder.block_inputs))

    def post_hook(optimizer, *_):
        state["step"] += 1
        if recorder.active:
            recorder.active = False
            state["graphs"].append(finish_graph())
        if len(state["graphs"]) == len(plan):
            raise StopScript
        if state["modules"] is None:
            state["modules"] = _modules_of(optimizer)
            found = repeated_blocks(state["modules"]) if scale_layers else None
            state["blocks"] = (found[0], found[1], len(found[0])) if found else None
            for block in (found[0] if found else []):
                hooks.append(block.register_forward_pre_hook(recorder.mark_block_input, with_kwargs=True))
            for root in state["modules"]:
                for name, p in root.named_parameters():
                    state["names"][id(p)] = name
                for name, b in root.named_buffers():
                    state["names"].setdefault(id(b), "buffer:" + name)
        names = state["names"]
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and id(p) in names:
                        names[id(value)] = f"state:{key}:{names[id(p)]}"
        keep = plan[len(state["graphs"])]
        if state["blocks"] and keep is not None:
            blocks = state["blocks"][0]
            while len(blocks) > keep:
                del blocks[len(blocks) - 1]
        recorder.start()

    hooks: list = []
    handle = register_optimizer_step_post_hook(post_hook)
    old_argv, old_path, old_default = sys.argv, list(sys.path), torch.get_default_device()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` has it: its own imports
    torch.set_default_device("meta")
    try:
        with MetaDevice(), attention.intercept(), distributed.script_parallelism_left_out(), recorder:
            runpy.run_path(script, run_name="__main__")
    except StopScript:
        pass
    except Exception as exc:
        if batch is None or not recorder.resized or recorder.script_batch == batch:
            raise
        raise InputError(f"{batch_option}: the script's batch cannot be changed (its step fails with batch "
                         f"{recorder.script_batch} made {batch}: {type(exc).__name__}: {str(exc).splitlines()[0]})") from exc
    finally:
        handle.remove()
        for hook in hooks:
            hook.remove()
        sys.argv = old_argv
        sys.path[:] = old_path
        torch.set_default_device(old_default)
    graphs = state["graphs"]
    if batch is not None and not recorder.resized and graphs:
        raise InputError(f"{batch_option}: the script's batch cannot be changed (its step draws no batch on the "
                         f"device and moves none there)")
    if len(graphs) < len(plan):
        raise RuntimeError(f"the script made {state['step']} optimizer step(s); projection records steps 2 to "
                           f"{len(plan) + 1} (give it more steps)")
    blocks = state["blocks"]
    if blocks is None:
        graphs = graphs[:1]
    return Recording(graphs, dict(state["names"]), blocks[2] if blocks else None, blocks[1] if blocks else None)
