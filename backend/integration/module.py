"""`torch.tpu`: the device module, mirroring Google's TorchTPU public names."""

from __future__ import annotations

import contextlib
import struct
import sys
from collections import namedtuple

import torch

from ..core.generations import current_generation
from ..core.modes import EagerMode, Precision, get_eager_mode, precision, set_eager_mode  # noqa: F401
from ..core.state import RNG, STATE

_DeviceProperties = namedtuple("_DeviceProperties", "name total_memory generation platform mxu peak_bf16_flops")


_claimed = False


def claim() -> None:
    """The tool's child (`tpu-agent run|profile|tune`) says this process runs on tpu, before the script starts."""
    global _claimed
    _claimed = True


def is_available() -> bool:
    """Whether code that takes "the accelerator, if there is one" should take tpu: Trainer and Accelerate ask
    `torch.accelerator.is_available()`, which asks this. Yes in the tool's child and once this process has run
    an op on tpu (the dispatcher is imported at the first); no in a plain-python process that never named tpu,
    so installing the tool changes nothing for a CPU script."""
    return _claimed or _DISPATCH in sys.modules


_DISPATCH = __package__.rpartition(".")[0] + ".aten.dispatch"


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def _lazy_init() -> None:
    return None


def device_count() -> int:
    """This process's local devices: the host's chips (or simulated CPU devices, `TPU_AGENT_DEVICES=N`), one
    per process under a launcher that gives each rank its chip (torchrun with one process per chip)."""
    from ..core.tensor import STATE  # starts JAX: the count is JAX's

    return STATE.device_count


def current_device() -> int:
    return STATE.device


def set_device(device) -> None:
    """Make `device` the current one: `torch.device("tpu")`, factories and `.to("tpu")` name it."""
    index = torch.device(device).index if not isinstance(device, int) else device
    if index is None or index < 0:  # torch.cuda.device(-1) and device_of(cpu tensor): no change
        return
    from ..core.tensor import check_index

    STATE.set_device(check_index(index))
    if STATE.device:
        _current_device_in_to()


def _current_device_in_to() -> None:
    """`t.to("tpu")` after `set_device(k)`: PyTorch's C++ fills a device's missing index from its device guard,
    which a Python backend cannot drive (it says 0), so `Tensor.to` names the current device first. Installed
    only once a device other than tpu:0 is made current: every other process keeps PyTorch's own `Tensor.to`."""
    original = torch.Tensor.to
    if getattr(original, "_tpu_agent", False):
        return

    def indexed(value):
        if value == "tpu" or (isinstance(value, torch.device) and value.type == "tpu" and value.index is None):
            return torch.device("tpu", STATE.device)
        return value

    def to(self, *args, **kwargs):
        if STATE.device:
            if args:
                args = (indexed(args[0]), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = indexed(kwargs["device"])
        return original(self, *args, **kwargs)

    to._tpu_agent = True
    to.__doc__ = original.__doc__
    torch.Tensor.to = to


class device:  # noqa: N801 - torch.cuda.device's name
    """Context manager selecting a tpu device, as `torch.cuda.device`."""

    def __init__(self, device):
        self.idx = _index(device)

    def __enter__(self):
        self.prev_idx = current_device()
        set_device(self.idx)
        return self

    def __exit__(self, *exc):
        set_device(self.prev_idx)
        return False


class device_of(device):  # noqa: N801
    """The device of a tensor as a context (a CPU tensor leaves the device unchanged)."""

    def __init__(self, obj):
        super().__init__(obj.get_device() if obj.device.type == "tpu" else -1)


def _index(device) -> int:
    if device is None or isinstance(device, int):
        return -1 if device is None else device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"Expected a tpu device, but got: {device}")
    return device.index if device.index is not None else current_device()


def _jax_platform() -> str:
    import jax

    return jax.default_backend()


def get_device_name(device=None) -> str:
    gen = current_generation()
    return f"TPU {gen.name} (tpu-agent bundled device on JAX {_jax_platform()})"


def get_device_properties(device=None):
    gen = current_generation()
    return _DeviceProperties(get_device_name(device), gen.hbm_bytes, gen.name, _jax_platform(), gen.mxu, gen.peak_bf16_flops)


def get_device_capability(device=None) -> dict:
    return {"generation": current_generation().name}


def synchronize(device=None) -> None:
    """Wait for all queued device work."""
    from ..core.transfer import synchronize as _sync

    _sync()


# --- streams: one in-order queue, as JAX dispatches (torch.Stream and Event from the device guard) ---

Stream = torch.Stream
Event = torch.Event


def current_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def default_stream(device=None) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def stream(s):
    """Context manager making `s` current (`torch.cuda.stream`'s shape; None changes nothing)."""
    return contextlib.nullcontext() if s is None else s


def compile(fn=None, **options):  # noqa: A001 - TorchTPU's name
    """Compile a training step (one XLA program) or a module (forward and backward programs)."""
    from ..compiled.compile import compile as _compile

    return _compile(fn, **options)


def compile_steps(on: bool = True, **options) -> None:
    """Run the loop's model (forward and backward) and optimizer updates as compiled programs,
    with no change to the script; `TPU_AGENT_COMPILE_STEPS=1` does the same from the start."""
    from ..compiled.auto_compile import compile_steps as _switch

    _switch(on, **options)


class _LazyModule:
    """`torch.tpu.sharding` without importing JAX at `import torch`."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        import importlib

        return getattr(importlib.import_module(f"..core.{self._name}", __package__), attr)


sharding = _LazyModule("sharding")


def mark_step() -> None:
    """Step boundary for scripts with no optimizer: flushes deferred work, notifies step hooks."""
    from ..core.steps import mark_step as _mark

    _mark()


# --- memory (JAX owns it; see memory.py) -------------------------------------

from ..core.memory import (  # noqa: E402,F401
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_stats,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats)

# --- RNG -------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    RNG.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    RNG.manual_seed(seed)


def seed() -> None:
    RNG.manual_seed(torch.seed())


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return RNG.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    """16 bytes, seed then counter (uint64, little-endian): CUDA's Philox layout, which DTensor's RNG tracker
    (FSDP2 and TorchTitan's parameter init) reads and moves the offset of."""
    seed_value, counter = RNG.get_state()
    return torch.tensor(list(struct.pack("<QQ", seed_value, counter)), dtype=torch.uint8)


def set_rng_state(new_state: torch.Tensor, device=None) -> None:
    seed_value, counter = struct.unpack("<QQ", bytes(new_state.to("cpu", torch.uint8).tolist()))
    RNG.set_state(seed_value, counter)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state_all(states) -> None:
    set_rng_state(states[0])


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]
