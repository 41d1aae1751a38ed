"""`--device-map cuda=tpu`: a script written for CUDA runs on `tpu` unedited, in the run's child only.

CUDA is a device type built into PyTorch, so its name cannot be given to our device. What a CUDA script
touches is mapped instead, for that run only: a `TorchFunctionMode` rewrites every device a torch call
names (`torch.device("cuda")`, `device="cuda"`, `.to("cuda")`, `.cuda()`, `is_cuda`); `torch.cuda`'s
functions answer for `tpu` (`is_available`, `synchronize`, seeds, memory); autocast and GradScaler built
for "cuda" are built for "tpu"; `torch.load(map_location="cuda")` loads onto `tpu`;
`torch.backends.cuda.matmul.allow_tf32` sets the matching `torch.tpu` matmul precision (the cuDNN flags
have no tpu meaning and stay flags). torch.distributed: "nccl" (alone or as "cuda:nccl") means the tpu
backend, `init_device_mesh("cuda", ...)` a tpu mesh, and in a launched job the rank's CUDA device
(`cuda:LOCAL_RANK`, `torch.cuda.set_device(LOCAL_RANK)`) is its one tpu device, index 0. Parsing is here
too, so the CLI and the child agree on the spelling.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref

from pydantic import BaseModel, ConfigDict

from tpu_agent.errors import InputError

SUPPORTED = (("cuda", "tpu"),)


class DeviceMap(BaseModel):
    """One device type a script names (`source`), run as another (`target`)."""

    model_config = ConfigDict(frozen=True)

    source: str
    target: str

    def spelled(self) -> str:
        return f"{self.source}={self.target}"


def parse(text: str) -> DeviceMap:
    """`FROM=TO` as typed after --device-map; InputError (exit 2, one line) for anything not supported."""
    source, eq, target = text.strip().partition("=")
    source, target = source.strip().lower(), target.strip().lower()
    if not eq or not source or not target:
        raise InputError(f"--device-map {text!r}: expected FROM=TO, e.g. --device-map cuda=tpu")
    if (source, target) not in SUPPORTED:
        supported = ", ".join(f"{a}={b}" for a, b in SUPPORTED)
        raise InputError(f"--device-map {text!r}: only {supported} is supported")
    return DeviceMap(source=source, target=target)


def start_line(mapping: DeviceMap) -> str:
    return (f"tpu-agent: --device-map {mapping.spelled()}: the script's CUDA calls run on {mapping.target} "
            "(torch.cuda, .cuda(), .to(\"cuda\"), device=\"cuda\", CUDA autocast and GradScaler, "
            "NCCL process groups)")


# ---------------------------------------------------------------- the mapping itself (in the child)


def _local_rank() -> int | None:
    """This rank's LOCAL_RANK in a job a launcher started (torchrun), else None."""
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() and os.environ.get("WORLD_SIZE", "1") != "1" else None


def _index(index):
    """A source device index as the target's: in a launched job each rank has one target device, index 0,
    so the rank's own CUDA index (LOCAL_RANK, what GPU scripts pass) is 0; any other stays as given."""
    return 0 if index is not None and index == _local_rank() else index


def _device(value, source: str, target: str):
    """`value` (a str, a torch.device, or None) with `source` replaced by `target`; anything else as is."""
    import torch

    if isinstance(value, torch.device):
        return torch.device(target, _index(value.index)) if value.type == source else value
    if isinstance(value, str):
        kind, colon, index = value.partition(":")
        if kind != source:
            return value
        return f"{target}:{_index(int(index))}" if index.isdigit() else f"{target}{colon}{index}"
    return value


def _function_mode(source: str, target: str):
    import torch
    from torch.overrides import TorchFunctionMode

    to_methods = {torch.Tensor.to, torch._C._nn._parse_to}
    cuda_method = torch.Tensor.cuda
    is_cuda = torch.Tensor.is_cuda  # its getter arrives as a fresh method-wrapper each time
    wrapper = type(is_cuda.__get__)
    new_device = torch.device

    class Mapped(TorchFunctionMode):
        """Every device named in a torch call, `source` read as `target` (kwargs and `.to`'s positionals)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is new_device:
                if len(args) == 2 and args[0] == source and isinstance(args[1], int):  # torch.device("cuda", i)
                    args = (target, _index(args[1]))
                elif args and isinstance(args[0], (str, new_device)):
                    args = (_device(args[0], source, target), *args[1:])
            elif func is cuda_method:
                index = args[1] if len(args) > 1 else kwargs.get("device")
                index = index.index if isinstance(index, new_device) else index
                where = target if index is None else f"{target}:{_index(index) if isinstance(index, int) else 0}"
                return args[0].to(where, non_blocking=bool(kwargs.get("non_blocking", False)))
            elif type(func) is wrapper and func.__self__ is is_cuda:
                return args[0].device.type in (source, target)
            elif func in to_methods and args:
                first = 0 if func is not torch.Tensor.to else 1
                if len(args) > first:
                    value = args[first]
                    if isinstance(value, int) and not isinstance(value, bool) and func is torch.Tensor.to:
                        value = f"{target}:{_index(value)}"  # `.to(0)`: CUDA device 0
                    args = (*args[:first], _device(value, source, target), *args[first + 1:])
            if "device" in kwargs:
                kwargs = {**kwargs, "device": _device(kwargs["device"], source, target)}
            return func(*args, **kwargs)

    return Mapped()


def _memory_bytes(kind: str) -> int:
    """Device memory as `torch.cuda.memory_*` reports it: XLA's own figures, else the live arrays' bytes."""
    import jax

    from tpu_agent.backend.core.memory import live_bytes

    stats = jax.local_devices()[0].memory_stats() or {}  # this rank's: devices()[0] is rank 0's
    key = {"allocated": "bytes_in_use", "peak": "peak_bytes_in_use", "reserved": "bytes_reserved"}[kind]
    if key in stats:
        return int(stats[key])
    return live_bytes(jax.live_arrays())


def _patch_cuda_module(torch, target: str) -> None:
    """`torch.cuda.*` answers for the target device (the functions a training script calls)."""
    tpu = torch.get_device_module(target)
    cuda = torch.cuda
    same = ("is_available", "device_count", "current_device", "set_device", "synchronize", "manual_seed",
            "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
            "get_rng_state_all", "set_rng_state_all", "get_device_name", "get_device_properties",
            "is_initialized", "device", "device_of")
    for name in same:
        if hasattr(tpu, name):
            setattr(cuda, name, getattr(tpu, name))
    cuda.set_device = lambda device: tpu.set_device(_index(device) if isinstance(device, int)
                                                    else _device(device, "cuda", target))
    cuda.device = lambda device: tpu.device(_index(device) if isinstance(device, int)
                                            else _device(device, "cuda", target))
    cuda.init = lambda: None
    cuda.is_bf16_supported = lambda including_emulation=True: True
    cuda.get_device_capability = lambda device=None: (8, 0)  # what bf16 and flash-attention checks ask for
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: _memory_bytes("allocated")
    cuda.max_memory_allocated = lambda device=None: _memory_bytes("peak")
    cuda.memory_reserved = lambda device=None: _memory_bytes("reserved")
    cuda.max_memory_reserved = lambda device=None: _memory_bytes("reserved")
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.reset_max_memory_allocated = lambda device=None: None


def _patch_amp(torch, source: str, target: str) -> None:
    """autocast("cuda") (and torch.cuda.amp.autocast, its subclass) and GradScaler("cuda") built for the target."""
    from torch.amp import autocast_mode, grad_scaler

    for cls, key in ((autocast_mode.autocast, "device_type"), (grad_scaler.GradScaler, "device")):
        original = cls.__init__

        @functools.wraps(original)
        def init(self, *args, __original=original, __key=key, **kwargs):
            if args:
                args = (_device(args[0], source, target), *args[1:])
            elif __key in kwargs:
                kwargs[__key] = _device(kwargs[__key], source, target)
            elif __key == "device":
                kwargs["device"] = target  # GradScaler() means CUDA
            __original(self, *args, **kwargs)

        cls.__init__ = init
    for name in ("is_autocast_enabled", "get_autocast_dtype", "set_autocast_enabled", "set_autocast_dtype"):
        original = getattr(torch, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def mapped(*args, __original=original, **kwargs):
            if args and isinstance(args[0], str):
                args = (_device(args[0], source, target), *args[1:])
            return __original(*args, **kwargs)

        setattr(torch, name, mapped)


def _patch_tf32(torch, target: str) -> None:
    """`torch.backends.cuda.matmul.allow_tf32 = True | False` sets the target's matmul precision the same way:
    TF32 (a reduced-precision f32 matmul) is HIGH, three bf16 passes; False asks for full f32, HIGHEST."""
    tpu = torch.get_device_module(target)
    precision = getattr(tpu, "Precision", None)
    if precision is None or not hasattr(tpu, "precision"):
        return
    cublas = type(torch.backends.cuda.matmul)
    original = cublas.__setattr__

    def setattr_(self, name, value):
        original(self, name, value)
        if name == "allow_tf32":
            tpu.precision(precision.HIGH if value else precision.HIGHEST)

    cublas.__setattr__ = setattr_


def _patch_load(torch, source: str, target: str) -> None:
    """`torch.load(map_location="cuda" | torch.device("cuda") | {"cpu": "cuda"})` loads onto the target."""
    original = torch.load

    @functools.wraps(original)
    def load(*args, **kwargs):
        location = kwargs.get("map_location")
        if isinstance(location, dict):
            kwargs["map_location"] = {k: _device(v, source, target) for k, v in location.items()}
        elif location is not None:
            kwargs["map_location"] = _device(location, source, target)
        return original(*args, **kwargs)

    torch.load = load


def _backend(backend, source: str, target: str):
    """A torch.distributed backend string with the source's ("nccl", "cuda:nccl") as the target's backend:
    "nccl" -> "tpu", "cpu:gloo,cuda:nccl" -> "cpu:gloo,tpu:tpu"; anything else as is."""
    from torch.distributed import Backend

    native = {"cuda": "nccl"}[source]
    text = str(backend) if backend is not None else ""
    if text.lower() == native:
        return Backend(target)
    if ":" not in text:
        return backend
    pairs = [pair.split(":", 1) for pair in text.lower().split(",")]
    if any(len(pair) != 2 for pair in pairs) or not any(d == source or n == native for d, n in pairs):
        return backend
    mapped = {target if device == source else device: target if name == native else name for device, name in pairs}
    return Backend(",".join(f"{device}:{name}" for device, name in mapped.items()))


def _patch_groups(dist, source: str, target: str) -> None:
    """NCCL process groups built with the target's backend: every group PyTorch creates goes through
    `_new_process_group_helper`. `dist.get_backend()` answers what the script named ("nccl", "cpu:gloo,cuda:nccl")
    for such a group and for a `new_group` that inherits it from the default group (what the script compares
    against); PyTorch's own code, which imports get_backend from distributed_c10d, sees the group's backend."""
    from torch.distributed import distributed_c10d as c10d

    asked = weakref.WeakKeyDictionary()  # group -> the backend the script named, where the map changed it
    helper = c10d._new_process_group_helper

    @functools.wraps(helper)
    def new_group(group_size, group_rank, global_ranks, backend, *args, **kwargs):
        mapped = _backend(backend, source, target)
        result = helper(group_size, group_rank, global_ranks, mapped, *args, **kwargs)
        default = c10d._world.default_pg
        if not isinstance(result[0], c10d.ProcessGroup):  # this rank is not in the group
            return result
        if mapped is not backend:
            asked[result[0]] = str(backend).lower()
        elif default in asked and str(backend) == str(c10d._world.pg_map[default][0]):  # new_group() inherits
            asked[result[0]] = asked[default]
        return result

    c10d._new_process_group_helper = new_group
    timeout = c10d._get_default_timeout  # init_process_group asks it first: NCCL's would warn "not compiled"
    c10d._get_default_timeout = functools.wraps(timeout)(lambda backend: timeout(_backend(backend, source, target)))
    get_backend = c10d.get_backend

    @functools.wraps(get_backend)
    def get_backend_as_asked(group=None):
        pg = group or c10d._get_default_group()
        return dist.Backend(asked[pg]) if pg in asked else get_backend(group)

    dist.get_backend = get_backend_as_asked


def _patch_mesh_and_ddp(torch, source: str, target: str) -> None:
    """`init_device_mesh("cuda", ...)` (every mesh goes through `DeviceMesh.__init__`) builds a target mesh;
    `DDP(model, device_ids=[LOCAL_RANK])` names the rank's one target device."""
    from torch.distributed import device_mesh

    mesh_init = device_mesh.DeviceMesh.__init__

    @functools.wraps(mesh_init)
    def mesh(self, device_type, *args, **kwargs):
        mesh_init(self, target if device_type == source else device_type, *args, **kwargs)

    device_mesh.DeviceMesh.__init__ = mesh
    ddp = torch.nn.parallel.DistributedDataParallel
    ddp_init = ddp.__init__

    def devices(value):
        return _index(value) if isinstance(value, int) else _device(value, source, target)

    @functools.wraps(ddp_init)
    def ddp_on_target(self, module, device_ids=None, output_device=None, *args, **kwargs):
        """DDP(model, device_ids=[LOCAL_RANK]): the rank's CUDA index, its one tpu device's index 0."""
        device_ids = None if device_ids is None else [devices(d) for d in device_ids]
        ddp_init(self, module, device_ids, None if output_device is None else devices(output_device), *args, **kwargs)

    ddp.__init__ = ddp_on_target


def _patch_distributed(torch, source: str, target: str) -> None:
    import torch.distributed as dist

    if dist.is_available():
        _patch_groups(dist, source, target)
        _patch_mesh_and_ddp(torch, source, target)


def apply(mapping: DeviceMap, say=None) -> None:
    """Map the source device onto the target for the rest of this process, and say so in one line (stderr)."""
    import torch

    source, target = mapping.source, mapping.target
    _patch_cuda_module(torch, target)
    _patch_amp(torch, source, target)
    _patch_load(torch, source, target)
    _patch_tf32(torch, target)
    _patch_distributed(torch, source, target)
    original_default = torch.set_default_device
    torch.set_default_device = functools.wraps(original_default)(
        lambda device: original_default(_device(device, source, target)))
    _function_mode(source, target).__enter__()  # for the whole run: left on the mode stack
    (say or (lambda line: print(line, file=sys.stderr, flush=True)))(start_line(mapping))
